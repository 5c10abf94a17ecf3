"""The disk tier of the KV cache: full blocks kept in files under the node's `kv_disk_dir`, so
that a node restarted on the same host finds the prefixes it computed before (LMCache's local disk
backend). Plain Python and bytes; node_agent/engine/kv_tiers.py decides what is written and read.

A block's file is content-addressed: `{kv_disk_dir}/{identity}/{chain hash}.kv`, where the identity
digest names what makes two caches' bytes interchangeable (the model's id, its source with its
revision and file, how its weights are quantized, the cache's dtype, block size and layout, and an
adapter, none yet) and the chain hash is the prefix cache's (node_agent/engine/blocks.py: the block's
tokens and all before it). Each file repeats the identity and the hash in its header with the
payload's length and CRC-32, and is read back only when all of them match: a corrupt, partial or
foreign file is ignored with a log line, never loaded. Files are written by a background thread
(to a temporary name, then renamed), and the directory is kept under `kv_disk_gb` by deleting the
least recently used (a model's directory: the budget is each model's).
"""

import hashlib
import json
import logging
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"CORTEXKV"
_HEADER_LENGTH = struct.Struct("<I")


def identity_digest(identity: dict) -> str:
    return hashlib.blake2b(
        json.dumps(identity, sort_keys=True).encode(), digest_size=12
    ).hexdigest()


class DiskTier:
    """One model's blocks under `root / identity_digest(identity)`, at most `budget_bytes` of them."""

    def __init__(self, root: Path, identity: dict, budget_bytes: int, block_bytes: int):
        self.identity, self.budget, self.block_bytes = identity, budget_bytes, block_bytes
        self.folder = Path(root) / identity_digest(identity)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, oldest first
        self.total = 0
        self.claimed: set[bytes] = set()  # to be written by this step
        self.writing: set[bytes] = set()  # queued for the writer, not yet on disk
        for path in sorted(self.folder.glob("*.kv"), key=lambda p: p.stat().st_mtime):
            try:
                block_hash = bytes.fromhex(path.stem)
            except ValueError:
                continue
            self.files[block_hash] = path.stat().st_size
            self.total += self.files[block_hash]
        for stale in self.folder.glob("*.tmp"):  # a write cut short by the process ending
            stale.unlink(missing_ok=True)
        self.queue: queue.Queue = queue.Queue()
        self.writer = threading.Thread(target=self._write_files, name="kv-disk", daemon=True)
        self.writer.start()
        log.info(
            "KV disk tier %s: %d blocks (%d MiB) of at most %d MiB",
            self.folder,
            len(self.files),
            self.total >> 20,
            budget_bytes >> 20,
        )

    def path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}.kv"

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.files

    def claim(self, block_hash: bytes) -> bool:
        """True (and claimed) if `block_hash` is neither on disk nor claimed yet."""
        if block_hash in self.files or block_hash in self.claimed:
            return False
        self.claimed.add(block_hash)
        return True

    def write(self, block_hash: bytes, payload: bytes) -> list[bytes]:
        """Queue a claimed block's file; returns the hashes evicted to stay within the budget."""
        self.claimed.discard(block_hash)
        header = json.dumps(
            self.identity
            | {"hash": block_hash.hex(), "bytes": len(payload), "crc": zlib.crc32(payload)}
        ).encode()
        data = MAGIC + _HEADER_LENGTH.pack(len(header)) + header + payload
        self.writing.add(block_hash)
        self.queue.put((block_hash, data))
        self.files[block_hash] = len(data)
        self.total += len(data)
        dropped = []
        while self.total > self.budget and len(self.files) > 1:
            old, size = self.files.popitem(last=False)
            self.total -= size
            self.queue.put((old, None))
            dropped.append(old)
        return dropped

    def read(self, block_hash: bytes) -> bytes | None:
        """The block's payload, or None (with a log line, and forgotten) if its file is missing,
        partial, corrupt or another cache's."""
        path = self.path(block_hash)
        if block_hash in self.writing:
            return None  # not on disk yet (it is in a tier above, or was just evicted)
        try:
            data = path.read_bytes()
        except OSError as exc:
            return self._refuse(block_hash, path, f"unreadable ({exc})")
        why = self._check(block_hash, data)
        if why:
            return self._refuse(block_hash, path, why)
        self.files.move_to_end(block_hash)
        return data[-self.block_bytes :]

    def _check(self, block_hash: bytes, data: bytes) -> str | None:
        """Why `data` is not this cache's block `block_hash` (None: it is)."""
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HEADER_LENGTH.size:
            return "not a KV block file"
        (length,) = _HEADER_LENGTH.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _HEADER_LENGTH.size
        try:
            header = json.loads(data[start : start + length])
        except ValueError:
            return "its header is unreadable"
        payload = data[start + length :]
        foreign = sorted(k for k, v in self.identity.items() if header.get(k) != v)
        if foreign:
            return (
                "another cache's block ("
                + ", ".join(f"{k} {header.get(k)!r}, not {self.identity[k]!r}" for k in foreign)
                + ")"
            )
        if header.get("hash") != block_hash.hex():
            return "it holds another block"
        if len(payload) != header.get("bytes") or len(payload) != self.block_bytes:
            return f"partial ({len(payload)} bytes of {self.block_bytes})"
        if zlib.crc32(payload) != header.get("crc"):
            return "corrupt (its checksum differs)"
        return None

    def _refuse(self, block_hash: bytes, path: Path, why: str) -> None:
        log.warning("KV disk tier: ignoring %s: %s", path, why)
        if block_hash in self.files:
            self.total -= self.files.pop(block_hash)
        return None

    def _write_files(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                block_hash, data = item
                path = self.path(block_hash)
                if data is None:
                    path.unlink(missing_ok=True)
                    continue
                temporary = path.with_suffix(".tmp")
                temporary.write_bytes(data)
                temporary.replace(path)
            except OSError as exc:
                log.warning("KV disk tier: writing a block failed: %s", exc)
            finally:
                if item is not None:
                    self.writing.discard(item[0])
                self.queue.task_done()

    def flush(self) -> None:
        """Wait until every queued file is written."""
        self.queue.join()

    def close(self) -> None:
        self.queue.put(None)
        self.writer.join()
