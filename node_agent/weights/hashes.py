"""A fetched file checked against the hub's metadata: its size, then its sha256 (LFS files) or its
git blob id (small files kept in git: sha1 of `blob {size}\\0` + the content)."""

import hashlib
from pathlib import Path

from shared.errors import ModelFileCorrupt
from shared.model_store import FileEntry

CHUNK = 1 << 20


def _digest(path: Path, hasher) -> str:
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def check(path: Path, entry: FileEntry, source: str) -> None:
    """ModelFileCorrupt (the file deleted) unless `path` is what `entry` describes."""
    size = path.stat().st_size
    if size != entry.size:
        problem = f"is {size} bytes, the hub says {entry.size}"
    elif entry.sha256:
        found = _digest(path, hashlib.sha256())
        problem = (
            f"has sha256 {found}, the hub says {entry.sha256}" if found != entry.sha256 else ""
        )
    elif entry.blob_id:
        found = _digest(path, hashlib.sha1(f"blob {size}\0".encode()))
        problem = (
            f"has git blob id {found}, the hub says {entry.blob_id}"
            if found != entry.blob_id
            else ""
        )
    else:
        problem = "has no hash in the hub's metadata to check it against"
    if problem:
        path.unlink(missing_ok=True)
        raise ModelFileCorrupt(
            f"{source}: {entry.name} {problem}; it was deleted and the model not loaded"
        )
