"""The models directory's budget (`models_disk_gb`): room for a pull is made by deleting the least
recently used model folders that are not protected (loaded, pinned, being pulled); a pull that
cannot fit even then fails, naming what holds the disk. Pulls in flight count at the size they
will have (their reservations), so that pulls at once never overshoot the budget."""

import logging

from shared.errors import DiskBudgetExceeded
from shared.model_store import ModelStore

log = logging.getLogger(__name__)


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def make_room(
    store: ModelStore,
    folder: str,
    size: int,
    budget_bytes: int | None,
    protected: dict[str, str],
    source: str,
    reserved: dict[str, int] | None = None,
) -> list[str]:
    """Room for `folder` to hold `size` bytes within `budget_bytes` (None: no budget), besides the
    folders of other pulls in flight, each `reserved` at its whole size; returns the folders
    deleted for it (interrupted pulls first, then by last use)."""
    if budget_bytes is None:
        return []
    reserved = {name: bytes_ for name, bytes_ in (reserved or {}).items() if name != folder}
    others = {name: used for name, used in store.usage().items() if name != folder}
    for name, coming in reserved.items():
        others[name] = max(others.get(name, 0), coming)
    evictable = sorted(
        (name for name in others if name not in protected and name not in reserved),
        key=store.last_used,
    )
    evicted = []
    while sum(others.values()) + size > budget_bytes and evictable:
        name = evictable.pop(0)
        log.info(
            "deleting the files of %s (%s, last used the longest ago) to make room for %s",
            name,
            _mb(others[name]),
            source,
        )
        store.remove(name)
        others.pop(name)
        evicted.append(name)
    if sum(others.values()) + size > budget_bytes:
        holders = ", ".join(
            f"{name} ({_mb(used)}, {protected.get(name, 'idle')})" for name, used in others.items()
        )
        raise DiskBudgetExceeded(
            f"{source} needs {_mb(size)} and models_disk_gb allows {_mb(budget_bytes)}: "
            f"the disk is held by {holders or 'nothing else'}, none of which may be deleted"
        )
    return evicted
