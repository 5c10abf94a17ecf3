"""What happens to the jobs a lost consumer (a node) had read and not finished: a job that had
sent output (`Keys.started`), or was already tried `MAX_DELIVERIES` times, ends with a `node_lost`
error event (in its event log too, so a client resuming it learns how it ended); any other goes
back on its stream once (a node's own stream: to the moved stream, which every node reads), so
its client only waits longer. Used by the gateway's janitor for dead nodes, and by a node that
starts under the name of one that died (a restarted container, a systemd restart) for the entries
its predecessor left."""

import logging

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared import event_log, queues
from shared.errors import NodeLost
from shared.keys import CONSUMER_GROUP, Keys
from shared.redis_conn import atomic, publish
from shared.wire import ErrorEvent, StreamEntry, pack_event

log = logging.getLogger(__name__)

MAX_DELIVERIES = 2  # a job is tried at most this often


def fail_job(
    pipe, keys: Keys, fields: dict[bytes, bytes], error: ErrorEvent, retention_s: float
) -> None:
    """Queue on `pipe` the job's end with `error`: in its log (if any), then to its listeners."""
    packed = pack_event(error)
    if job := StreamEntry.job_of(fields):
        event_log.append(pipe, keys.event_log(job), [packed], retention_s)
    publish(pipe, StreamEntry.channel_of(fields), packed, sharded=keys.cluster)


async def recover_consumer(
    redis: aioredis.Redis, keys: Keys, stream: str, consumer: str, retention_s: float
) -> bool:
    """Requeue or fail what `consumer` had read from `stream`, then delete the consumer; False when
    the stream has no such group or consumer."""
    started = await redis.smembers(keys.started(consumer))
    try:
        pending = await redis.xpending_range(
            stream, CONSUMER_GROUP, min="-", max="+", count=1000, consumername=consumer
        )
    except ResponseError:  # no group yet
        return False
    for entry in pending:
        await _recover(redis, keys, stream, entry["message_id"], consumer, started, retention_s)
    return bool(await redis.xgroup_delconsumer(stream, CONSUMER_GROUP, consumer)) or bool(pending)


async def _recover(
    redis: aioredis.Redis,
    keys: Keys,
    stream: str,
    entry_id: bytes,
    node: str,
    started: set[bytes],
    retention_s: float,
) -> None:
    entries = await redis.xrange(stream, entry_id, entry_id)
    if not entries:
        await redis.xack(stream, CONSUMER_GROUP, entry_id)
        return
    fields = entries[0][1]
    retries = int(fields.get(b"retries", b"0"))
    job = fields.get(b"job", b"?").decode(errors="replace")
    async with atomic(redis) as pipe:
        if fields.get(b"job") in started or retries + 1 >= MAX_DELIVERIES:
            error = NodeLost(f"node {node} was lost while it ran job {job}")
            fail_job(
                pipe, keys, fields, ErrorEvent(code=error.code, message=error.message), retention_s
            )
            log.warning("job=%s failed: node %s lost", job, node)
        else:
            name = queues.parse(keys, stream)
            again = stream
            if name is not None and name.node is not None:  # a node's own stream: to every node
                again = keys.moved_jobs(name.model, name.job_class, name.band)
                pipe.hincrby(keys.routing(name.model), "moved", 1)
            pipe.xadd(again, {**fields, b"retries": str(retries + 1).encode()})
            log.warning("job=%s requeued: node %s lost", job, node)
        pipe.xack(stream, CONSUMER_GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        await pipe.execute()
