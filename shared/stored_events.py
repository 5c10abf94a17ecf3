"""Events a node stored rather than published (`shared.wire.StoredEvent`): an event larger than the
node's `max_event_bytes` waits in the job's `Keys.result` hash (node_agent/serving/publisher.py
writes it) and travels on pub/sub and in the event log as a pointer. Whoever reads a job's events
(gateway/jobs/job.py, gateway/jobs/background.py) resolves pointers here, one HGET each."""

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.errors import GenerationFailed
from shared.keys import Keys
from shared.redis_conn import broker_error
from shared.wire import Event, StoredEvent, WireError, unpack_event


async def resolve(redis: aioredis.Redis, keys: Keys, job: str, event: Event) -> Event:
    """`event`, or the event a `StoredEvent` points to; GenerationFailed when it is gone (its hash
    expired: `stream_retention_s` after it was written) or unreadable, BrokerUnavailable when Redis
    does not answer."""
    if not isinstance(event, StoredEvent):
        return event
    try:
        packed = await redis.hget(keys.result(job), event.field)
    except RedisError as exc:
        raise broker_error(exc, "could not read the job's stored result") from exc
    if packed is None:
        raise GenerationFailed(f"the stored result of job {job} expired before it was read")
    try:
        return unpack_event(packed)
    except WireError as exc:
        raise GenerationFailed(f"the node stored a result this gateway cannot read: {exc}") from exc


async def resolve_all(
    redis: aioredis.Redis, keys: Keys, job: str, events: list[Event]
) -> list[Event]:
    return [await resolve(redis, keys, job, event) for event in events]
