"""Lifecycle commands for one node, entries on `cortex:cmd:{node}` (readable in redis-cli)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.wire import WireError


class NodeCommand(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # pull: fetch the model's files (no load); rm: delete them (unless loaded, pinned or being pulled)
    cmd: Literal["load", "unload", "drain", "pull", "rm"]
    model: str = ""
    by: str = ""  # who sent it (a gateway, the CLI)
    sent_ms: int = 0

    def to_fields(self) -> dict[str, str | int]:
        return self.model_dump()

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> "NodeCommand":
        try:
            return cls.model_validate({k.decode(): v.decode() for k, v in fields.items()})
        except ValidationError as exc:
            raise WireError(f"bad node command: {exc}") from exc
