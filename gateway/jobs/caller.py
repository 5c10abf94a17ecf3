"""Whose job it is: the API key a request came with (or `admin`, or `anonymous` while auth is off).
Its tokens count against the key's budgets; only it may resume its streams. The HTTP side finds the
caller from the request's headers (gateway/http/auth.py)."""

from contextvars import ContextVar
from dataclasses import dataclass

from shared.api_keys import ADMIN, ANONYMOUS, ApiKey
from shared.catalog import ModelProfile
from shared.errors import ModelNotAllowed, Unauthorized

caller_var: ContextVar[str] = ContextVar("caller", default="-")  # the key's name, for log lines


@dataclass(frozen=True)
class Caller:
    name: str  # the key's name, `admin` or `anonymous`
    key: ApiKey | None = None  # None: admin or anonymous, which no limit applies to

    @property
    def owner(self) -> str | None:
        """Whose files and batches the caller sees: its own, or (admin) everyone's (None)."""
        return None if self.name == ADMIN else self.name

    def may_use(self, names: set[str]) -> bool:
        """Whether the caller may use the model with these names (its id and aliases)."""
        return self.key is None or self.key.may_use(names)

    def check_may_use(self, profile: ModelProfile) -> None:
        """401 if the key was revoked or expired since (a batch runs for a while), 404/403 if it may
        not use the model."""
        if self.key is None:
            return
        if (state := self.key.state()) != "active":
            raise Unauthorized(
                f"API key {self.name!r} ({self.key.hint}…) is {state}; ask an operator for another"
            )
        if not self.may_use({profile.id, *profile.aliases}):
            raise ModelNotAllowed(
                f"The model `{profile.id}` does not exist or API key {self.name!r} may not use it",
                param="model",
            )


ADMIN_CALLER, ANONYMOUS_CALLER = Caller(ADMIN), Caller(ANONYMOUS)
