"""What a GGUF file's header says, parsed once per file per process: the architecture, its
numeric fields, the vocabulary's size and where each tensor lies. The `gguf` package's reader
parses every field, the vocabulary's tokens one small array each (seconds for a 50k-token
vocabulary), and placement's estimate (shared/memory.py), the choice to load quantized and the
loader itself (node_agent/model/gguf_loader.py) all need the header: they share this record, which
keeps no token and no mapping of the file. It is also kept as JSON under the node's convert cache
(`CORTEX_CONVERT_CACHE`/gguf-headers), so a restarted node or a test run's next process skips the
parse too (files with a vocabulary of KEEP_VOCAB tokens or more: the tokens are what the parse
spends its time on, and a small file's header is read about as fast as its JSON)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)
KEEP_VOCAB = 10_000


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's place in the file and the array the reader would give for it (quantized
    types: rows of blocks as uint8)."""

    name: str
    shape: tuple[int, ...]  # as GGUF lists it (innermost first)
    gguf_type: str  # the GGML type's name
    elements: int
    n_bytes: int
    data_offset: int
    data_dtype: str  # numpy dtype of the reader's array
    data_shape: tuple[int, ...]


@dataclass(frozen=True)
class GGUFHeader:
    architecture: str
    numbers: dict[str, int | float]  # every scalar numeric field, by its full name
    vocab_size: int  # the field, else the tokenizer's token count
    tensors: tuple[TensorInfo, ...]

    def number(self, name: str, default: int = 0) -> int:
        """The architecture's field `name` ("block_count" reads "llama.block_count")."""
        return int(self.numbers.get(f"{self.architecture}.{name}", default))


def read(path: Path | str) -> GGUFHeader:
    """The file's header; parsed again only when the file changed (size or modification time)."""
    stat = os.stat(path)
    return _parse(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=16)
def _parse(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    kept = _kept_at(path, size, mtime_ns)
    if kept is not None and kept.exists():
        try:
            doc = json.loads(kept.read_text())
            return GGUFHeader(
                doc["architecture"],
                doc["numbers"],
                doc["vocab_size"],
                tuple(
                    TensorInfo(
                        **{**t, "shape": tuple(t["shape"]), "data_shape": tuple(t["data_shape"])}
                    )
                    for t in doc["tensors"]
                ),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the kept header %s: %s", kept, exc)
    header = _read_file(path)
    if kept is not None and header.vocab_size >= KEEP_VOCAB:
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            partial = kept.with_name(kept.name + f".{os.getpid()}.partial")
            partial.write_text(json.dumps(asdict(header)))
            partial.replace(kept)
        except OSError as exc:  # a cache that cannot be written only costs time
            log.warning("could not keep %s's header at %s: %s", path, kept, exc)
    return header


def _kept_at(path: str, size: int, mtime_ns: int) -> Path | None:
    from shared.settings import NodeSettings

    cache = NodeSettings().convert_cache
    return cache / "gguf-headers" / f"{Path(path).stem}-{size}-{mtime_ns}.json" if cache else None


def _read_file(path: str) -> GGUFHeader:
    from shared.gguf_parse import read as read_bounded  # imports this module's records

    return read_bounded(path)
