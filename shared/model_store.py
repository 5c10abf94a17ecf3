"""A node's models directory: one folder per hub model (`org--name`, `org--name@revision`), its files
as the hub names them, and a manifest written only once every file's size and hash were checked.
A folder without its manifest is a pull in progress (or an interrupted one, resumed by the next
pull); only a folder with one may be loaded, served to peers, or counted as held. No torch here:
the gateway reads manifests (placement, `cortex models rm`) as the nodes write them."""

import re
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from shared.errors import InvalidRequest, ModelPullFailed

HUB_PREFIX = "hf:"
MANIFEST = "cortex-manifest.json"
LAST_USED = (
    "cortex-last-used"  # touched when a replica loads from the folder (its mtime orders eviction)
)
WORK_DIR = ".cache"  # partial files and the hub client's own bookkeeping, under each folder
# A repo id (the hub's own rule: letters, digits, '-', '_', '.', not starting or ending with '-' or
# '.', no '--' or '..'), as `name` or `org/name`; a revision: a 40-hex commit, or a branch or tag
# name of the same characters (no '/': it names a folder; the hub's `refs/pr/N` is not taken).
_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO = re.compile(rf"(?:{_NAME}/)?{_NAME}")
_REVISION = re.compile(_NAME)
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubRef(BaseModel):
    """`hf:org/name[@revision]`."""

    model_config = ConfigDict(frozen=True)

    repo: str
    revision: str | None = None

    @classmethod
    def parse(cls, source: str) -> "HubRef":
        if not source.startswith(HUB_PREFIX):
            raise InvalidRequest(f"{source!r} is not a hub source (hf:org/name[@revision])")
        repo, at, revision = source[len(HUB_PREFIX) :].partition("@")
        if not _REPO.fullmatch(repo) or "--" in repo or ".." in repo:
            raise InvalidRequest(f"{source!r}: a hub source is hf:org/name[@revision]")
        if at and (not _REVISION.fullmatch(revision) or ".." in revision):
            raise InvalidRequest(
                f"{source!r}: a revision is a branch or tag name (letters, digits, '-', '_', '.') "
                "or a 40-hex commit"
            )
        return cls(repo=repo, revision=revision or None)

    @staticmethod
    def is_commit(revision: str | None) -> bool:
        """Whether `revision` pins a commit (40 hex digits) rather than naming a branch or tag."""
        return bool(revision and _COMMIT.fullmatch(revision))

    @property
    def folder(self) -> str:
        """The folder's name in a models directory."""
        name = self.repo.replace("/", "--")
        return f"{name}@{self.revision}" if self.revision else name


class FileEntry(BaseModel):
    """One file of a model as the hub describes it: LFS files carry a sha256, others a git blob id.
    Its name is a path inside the model's folder (`1_Pooling/config.json`), never out of it."""

    model_config = ConfigDict(extra="forbid")

    name: str
    size: int
    sha256: str = ""
    blob_id: str = ""

    @field_validator("name")
    @classmethod
    def _not_a_parent(cls, name: str) -> str:
        if "\\" in name or any(part in ("", ".", "..") for part in name.split("/")):
            raise ValueError(f"{name!r} is not the path of a file inside a model folder")
        return name


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str  # hf:org/name[@revision]
    commit: str  # the hub's commit the files come from
    files: list[FileEntry]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def inside(folder: Path, name: str) -> Path:
    """`folder / name`, refused (ModelPullFailed) unless it stays inside `folder` once symlinks and
    '..' are resolved: a file a pull writes or a peer is served never lands elsewhere."""
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ModelPullFailed(f"{name!r} resolves outside its model folder ({path.resolve()})")
    return path


def partial_path(folder: Path, name: str) -> Path:
    """Where a file of `folder` grows until it is whole (kept across restarts: the next pull resumes it)."""
    path = inside(folder, f"{WORK_DIR}/{name}.partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class ModelStore:
    """The models directory of one node."""

    def __init__(self, root: Path):
        self.root = Path(root).expanduser()

    def folder(self, name: str) -> Path:
        """The folder `name` (one path component), refused unless it resolves inside the root."""
        folder = self.root / name
        if "/" in name or name in ("", ".", "..") or folder.resolve().parent != self.root.resolve():
            raise ModelPullFailed(f"{name!r} is not a folder inside the models directory")
        return folder

    def manifest(self, name: str) -> Manifest | None:
        """The folder's manifest: None while it is not complete."""
        try:
            return Manifest.model_validate_json((self.folder(name) / MANIFEST).read_text())
        except (OSError, ValueError):
            return None

    def complete(self, manifest: Manifest) -> None:
        """Every file is here and checked: write the manifest (atomically) that makes the folder whole."""
        folder = self.folder(HubRef.parse(manifest.source).folder)
        staged = folder / f"{MANIFEST}.partial"
        staged.write_text(manifest.model_dump_json(indent=1))
        staged.rename(folder / MANIFEST)
        shutil.rmtree(folder / WORK_DIR, ignore_errors=True)
        self.touch(folder.name)

    def held(self) -> dict[str, Manifest]:
        """Complete folders by name."""
        if not self.root.is_dir():
            return {}
        return {
            p.name: m
            for p in sorted(self.root.iterdir())
            if _ours(p) and (m := self.manifest(p.name))
        }

    def touch(self, name: str) -> None:
        (self.folder(name) / LAST_USED).touch()

    def last_used(self, name: str) -> float:
        try:
            return (self.folder(name) / LAST_USED).stat().st_mtime
        except OSError:
            return 0.0

    def bytes_in(self, name: str) -> int:
        """What the folder takes on disk now (partial files included)."""
        folder = self.folder(name)
        return (
            sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            if folder.is_dir()
            else 0
        )

    def usage(self) -> dict[str, int]:
        """Bytes on disk by folder, complete or not."""
        if not self.root.is_dir():
            return {}
        return {p.name: self.bytes_in(p.name) for p in sorted(self.root.iterdir()) if _ours(p)}

    def remove(self, name: str) -> int:
        """Delete a folder; returns the bytes it held. The manifest goes first, so a folder half
        deleted is never taken for a whole one."""
        size = self.bytes_in(name)
        (self.folder(name) / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(self.folder(name), ignore_errors=True)
        return size


def _ours(path: Path) -> bool:
    """A model folder of the models directory: a directory, not a link to one elsewhere."""
    return path.is_dir() and not path.is_symlink()
