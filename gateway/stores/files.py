"""Files for `/v1/files` and the batch worker, kept in Redis so every gateway replica and every
batch worker sees them and they survive restarts: `cortex:file:{id}` is a hash of the file's
metadata fields plus `content`, and `cortex:files` lists the ids by creation time.

Limits (GatewaySettings): `files_max_bytes` (64 MiB) per upload, `files_max_lines` (50,000) per batch
input file, and `files_max_total_bytes` (1 GiB) for every file kept (`cortex:files:bytes` counts them);
an upload over any is refused with 413. Redis holds every file in memory and on disk until it is
deleted (`DELETE /v1/files/{id}`). Batch output files count towards the total but are never refused:
a finished batch keeps its results, and later uploads wait for room.

Each file belongs to the API key that uploaded it (its batch's key, for batch output): the hash's
`owner` field. Other keys never see it; the admin key sees every file.
"""

import time
import uuid

import redis.asyncio as aioredis

from gateway.dialects.protocol.openai_batch import FileList, FileObject
from shared.api_keys import ANONYMOUS
from shared.errors import FilesQuotaExceeded, InvalidRequest, NotFound, PayloadTooLarge
from shared.keys import Keys

PURPOSES = ("batch",)  # what clients may upload; batches write `batch_output`

# KEYS: file hash, files zset, bytes counter. ARGV: id, created, size, quota (0: none), meta, owner, content.
# Returns {1, total} when stored, {0, total} when it would pass the quota.
_CREATE = """
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local size, quota = tonumber(ARGV[3]), tonumber(ARGV[4])
if quota > 0 and total + size > quota then return {0, total} end
redis.call('HSET', KEYS[1], 'meta', ARGV[5], 'owner', ARGV[6], 'content', ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return {1, redis.call('INCRBY', KEYS[3], size)}
"""
# KEYS: file hash, files zset, bytes counter. ARGV: id. Returns whether the file existed.
_DELETE = """
local size = redis.call('HSTRLEN', KEYS[1], 'content')
local deleted = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if deleted == 1 and redis.call('EXISTS', KEYS[3]) == 1 then redis.call('DECRBY', KEYS[3], size) end
return deleted
"""


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def check_batch_input(content: bytes, *, max_bytes: int, max_lines: int) -> None:
    """Refuse an upload over the limits (413) or an empty one (400); lines are checked when a batch runs."""
    if len(content) > max_bytes:
        raise PayloadTooLarge(
            f"the file is {len(content)} bytes; the limit is {max_bytes} bytes (files_max_bytes)",
            param="file",
        )
    lines = sum(1 for line in content.splitlines() if line.strip())
    if lines == 0:
        raise InvalidRequest(
            "the file has no lines; a batch input file holds one JSON request per line",
            param="file",
        )
    if lines > max_lines:
        raise PayloadTooLarge(
            f"the file has {lines} lines; the limit is {max_lines} lines (files_max_lines)",
            param="file",
        )


class FileStore:
    """Every method that takes `owner` sees only that owner's files (another's are 404, as if they
    did not exist); `owner=None` sees every file (the admin key, the batch worker)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.redis, self.keys = redis, keys
        self._create = redis.register_script(_CREATE)
        self._delete = redis.register_script(_DELETE)

    async def create(
        self, content: bytes, *, filename: str, purpose: str, owner: str, quota_bytes: int | None
    ) -> FileObject:
        """Store a file; with `quota_bytes`, refuse it (413) if every file kept would then pass it."""
        meta = FileObject(
            id=new_file_id(),
            bytes=len(content),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        await self._count_once()
        stored, total = await self._create(
            keys=[self.keys.file(meta.id), self.keys.files(), self.keys.files_bytes()],
            args=[
                meta.id,
                time.time(),
                len(content),
                quota_bytes or 0,
                meta.model_dump_json(),
                owner,
                content,
            ],
        )
        if not stored:
            raise FilesQuotaExceeded(
                f"storing this file ({len(content)} bytes) would bring the files kept to "
                f"{total + len(content)} bytes, over files_max_total_bytes={quota_bytes}; delete "
                "files you no longer need (DELETE /v1/files/{id})",
                param="file",
            )
        return meta

    async def _count_once(self) -> None:
        """Start `cortex:files:bytes` from the files already kept (those stored before it existed)."""
        if await self.redis.exists(self.keys.files_bytes()):
            return
        ids = await self.redis.zrange(self.keys.files(), 0, -1)
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hstrlen(self.keys.file(file_id.decode()), "content")
            sizes = await pipe.execute() if ids else []
        await self.redis.set(self.keys.files_bytes(), sum(sizes), nx=True)

    async def _field(self, file_id: str, field: str, owner: str | None) -> bytes:
        raw, file_owner = await self.redis.hmget(self.keys.file(file_id), [field, "owner"])
        if raw is None or not visible(file_owner, owner):
            raise NotFound(f"no file with id {file_id!r}", param="file_id")
        return raw

    async def get(self, file_id: str, owner: str | None = None) -> FileObject:
        return FileObject.model_validate_json(await self._field(file_id, "meta", owner))

    async def content(self, file_id: str, owner: str | None = None) -> bytes:
        return await self._field(file_id, "content", owner)

    async def delete(self, file_id: str, owner: str | None = None) -> None:
        await self._field(file_id, "owner", owner)
        deleted = await self._delete(
            keys=[self.keys.file(file_id), self.keys.files(), self.keys.files_bytes()],
            args=[file_id],
        )
        if not deleted:
            raise NotFound(f"no file with id {file_id!r}", param="file_id")

    async def list(
        self,
        *,
        purpose: str | None,
        limit: int,
        after: str | None,
        order: str,
        owner: str | None = None,
    ) -> FileList:
        ids = [
            i.decode()
            for i in await self.redis.zrange(self.keys.files(), 0, -1, desc=order == "desc")
        ]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        found: list[FileObject] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            async with self.redis.pipeline(transaction=False) as pipe:
                for file_id in chunk:
                    pipe.hmget(self.keys.file(file_id), ["meta", "owner"])
                metas = await pipe.execute()
            found += [
                m
                for raw, file_owner in metas
                if raw
                and visible(file_owner, owner)
                and (m := FileObject.model_validate_json(raw))
                and (purpose is None or m.purpose == purpose)
            ]
            if len(found) > limit:
                break
        page = found[:limit]
        return FileList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(found) > limit,
        )


def visible(stored_owner: bytes | str | None, owner: str | None) -> bool:
    """Whether a file or batch stored with `stored_owner` is visible to `owner` (None: to everyone).
    Those stored before keys existed have no owner and belong to `anonymous`."""
    if owner is None:
        return True
    stored = stored_owner.decode() if isinstance(stored_owner, bytes) else stored_owner
    return (stored or ANONYMOUS) == owner
