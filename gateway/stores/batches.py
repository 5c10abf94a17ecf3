"""Batch objects in Redis: `cortex:batch:{id}` is a hash with one JSON value per field of
OpenAI's batch object, so the gateway (cancel) and the worker (counts, status) update different
fields without overwriting each other; status changes go through one Lua script that checks the
current status first. `cortex:batches` (zset by creation) lists them; `cortex:batches:active`
holds the ones not yet finished. A batch belongs to the API key that created it (the hash's
`owner` field, beside the OpenAI fields): methods taking `owner` see only that owner's batches,
`owner=None` sees every batch."""

import json
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from arq.connections import ArqRedis

from gateway.dialects.protocol.openai_batch import (
    TERMINAL,
    Batch,
    BatchList,
    BatchRequestCounts,
    CreateBatchRequest,
)
from gateway.stores.files import visible
from shared.api_keys import ANONYMOUS
from shared.errors import InvalidRequest, NotFound
from shared.keys import Keys
from shared.redis_conn import atomic

COMPLETION_WINDOW_S = 24 * 3600
LIST_SCAN = 100  # batch ids read per round when listing one owner's batches

# KEYS[1] batch hash, KEYS[2] active set; ARGV: batch id, new status, timestamp field ('' for none),
# timestamp, then the statuses it may change from. Returns the status it had (nil: no such batch).
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return nil end
for i = 5, #ARGV do
  if cur == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[2])
    if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], ARGV[3], ARGV[4]) end
    return cur
  end
end
return cur
"""


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def _dump(fields: dict[str, Any]) -> dict[str, str]:
    return {name: json.dumps(value) for name, value in fields.items()}


class BatchStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys):
        self.redis, self.keys = redis, keys
        self._transition = redis.register_script(_TRANSITION)

    async def create(self, body: CreateBatchRequest, owner: str, lines: int = 0) -> Batch:
        """A new batch, `validating`; `lines`: its request count when known already (the worker counts them)."""
        now = int(time.time())
        batch = Batch(
            id=new_batch_id(),
            endpoint=body.endpoint,
            input_file_id=body.input_file_id,
            completion_window=body.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + COMPLETION_WINDOW_S,
            metadata=body.metadata,
            request_counts=BatchRequestCounts(total=lines),
        )
        async with atomic(self.redis) as pipe:
            pipe.hset(
                self.keys.batch(batch.id),
                mapping=_dump(batch.model_dump(mode="json") | {"owner": owner}),
            )
            pipe.zadd(self.keys.batches(), {batch.id: time.time() * 1000})
            pipe.sadd(self.keys.batches_active(), batch.id)
            await pipe.execute()
        return batch

    async def get(self, batch_id: str, owner: str | None = None) -> Batch:
        fields = {
            k.decode(): json.loads(v)
            for k, v in (await self.redis.hgetall(self.keys.batch(batch_id))).items()
        }
        if not fields or not visible(fields.pop("owner", None), owner):
            raise NotFound(f"no batch with id {batch_id!r}", param="batch_id")
        return Batch.model_validate(fields)

    async def owner(self, batch_id: str) -> str:
        """The API key the batch belongs to (`anonymous` for batches made before keys existed)."""
        raw = await self.redis.hget(self.keys.batch(batch_id), "owner")
        return json.loads(raw) if raw else ANONYMOUS

    async def update(self, batch_id: str, **fields: Any) -> None:
        await self.redis.hset(self.keys.batch(batch_id), mapping=_dump(fields))

    async def transition(
        self, batch_id: str, to: str, *, from_: tuple[str, ...], stamp: str | None = None
    ) -> str | None:
        """Set status `to` (and `stamp` = now) if the status is one of `from_`; returns the
        status it had, so `== from_` tells whether it changed. Terminal statuses leave the active set."""
        had = await self._transition(
            keys=[self.keys.batch(batch_id)],
            args=[
                batch_id,
                json.dumps(to),
                stamp or "",
                json.dumps(int(time.time())),
                *map(json.dumps, from_),
            ],
        )
        if had is None:
            raise NotFound(f"no batch with id {batch_id!r}", param="batch_id")
        had = json.loads(had)
        if had in from_ and to in TERMINAL:
            await self.redis.srem(self.keys.batches_active(), batch_id)
        return had

    async def cancel(self, batch_id: str, owner: str | None) -> Batch:
        """Ask the batch's worker to stop new lines (lines already running finish); a 404 for
        another owner's batch, a 400 for one that has ended."""
        await self.get(batch_id, owner)
        had = await self.transition(
            batch_id, "cancelling", from_=("validating", "in_progress"), stamp="cancelling_at"
        )
        if had not in ("validating", "in_progress", "cancelling", "cancelled"):
            raise InvalidRequest(
                f"batch {batch_id} is {had}; it can no longer be cancelled", param="batch_id"
            )
        return await self.get(batch_id)

    async def active(self) -> list[str]:
        return [i.decode() for i in await self.redis.smembers(self.keys.batches_active())]

    async def list(
        self,
        *,
        after: str | None,
        limit: int,
        owner: str | None = None,
        endpoint: str | None = None,
    ) -> BatchList:
        """Newest first, `limit` per page after the batch `after`, only `owner`'s (None: all), only
        those for `endpoint` if given."""
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(self.keys.batches(), after)
            start = rank + 1 if rank is not None else 0
        found: list[Batch] = []
        while len(found) <= limit:
            ids = [
                i.decode()
                for i in await self.redis.zrevrange(
                    self.keys.batches(), start, start + LIST_SCAN - 1
                )
            ]
            for batch_id in ids:
                try:
                    batch = await self.get(batch_id, owner)
                except NotFound:  # another owner's, or deleted between the two reads
                    continue
                if endpoint in (None, batch.endpoint):
                    found.append(batch)
            if len(ids) < LIST_SCAN:
                break
            start += LIST_SCAN
        page = found[:limit]
        return BatchList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(found) > limit,
        )


async def enqueue(redis: aioredis.Redis, keys: Keys, batch_id: str) -> None:
    """Ask some batch worker to run `batch_id` (a unique arq job: the lease stops doubles)."""
    arq = ArqRedis(pool_or_conn=redis.connection_pool, default_queue_name=keys.arq_queue())
    await arq.enqueue_job(
        "run_batch", batch_id, _job_id=f"run-batch:{batch_id}:{uuid.uuid4().hex[:8]}"
    )
