"""The base of every request type in both dialects: a field this gateway does not know is
ignored (and logged once per field name), so a newer client is never refused for sending one;
a known field with a wrong type or value is still a 400."""

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

log = logging.getLogger(__name__)

_noted: set[str] = set()


def note_unknown(where: str, name: str) -> None:
    """Log an ignored field the first time this process sees it."""
    key = f"{where}.{name}"
    if key not in _noted:
        _noted.add(key)
        log.info("ignoring unknown field %s (logged once)", key)


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = {alias for f in cls.model_fields.values() if (alias := f.alias)} | set(
                cls.model_fields
            )
            for name in data.keys() - known:
                note_unknown(cls.__name__, str(name))
        return data
