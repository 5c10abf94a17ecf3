"""Putting a job on the queues, where a waiting job stands there, and taking back a job nobody has
read yet (the per-model summary behind `GET /v1/queue` is `shared.fleet.Fleet.queues`). One Lua
script per question, so each answer is one atomic round trip (scripts in shared/queues.py). A job
asks through `Job.position` (gateway/jobs/job.py); background responses and batch lines, which
keep only the entry's id, ask here. `enqueue` is `submit`'s last step (gateway/jobs/submit.py):
the job goes to its stream, or to its caller's waiting room when the shared stream already has a
job nobody has read (fair shares between keys), or nowhere when too many wait (`QueueFull`)."""

from contextvars import ContextVar

import redis.asyncio as aioredis

from shared import queues
from shared.errors import QueueFull
from shared.keys import CONSUMER_GROUP, Keys
from shared.settings import GatewaySettings

POSITION_CAP = 10_000  # positions are counted exactly up to this many jobs ahead
RETRY_AFTER_S = 5  # what `Retry-After` says to a request refused for a full queue or its deadline
TIMEOUT_HEADER = b"x-cortex-queue-timeout"  # seconds a request may wait in the queue
timeout_header_var: ContextVar[str] = ContextVar("queue_timeout_header", default="")


def timeout_s(settings: GatewaySettings) -> float:
    """How long this request may wait in the queue (0: as long as `request_timeout_s`): its
    `x-cortex-queue-timeout` header (seconds, up to `request_timeout_s`), else `queue_timeout_s`."""
    try:
        asked = float(timeout_header_var.get() or "nan")
    except ValueError:
        asked = float("nan")
    if asked > 0:  # NaN (none, or not a number) is not
        return min(asked, settings.request_timeout_s)
    return settings.queue_timeout_s


async def enqueue(
    redis: aioredis.Redis,
    keys: Keys,
    stream: str,
    fields: dict,
    *,
    tenant: str,
    max_waiting: int,
    maxlen: int,
) -> tuple[str, str]:
    """Queue a job for `stream` (a model's shared stream, or a node's own) on behalf of `tenant`
    (the caller's name): (the stream or waiting room it went to, its entry id). Raises `QueueFull`
    when more than `max_waiting` jobs of its class wait for its model already (0: no limit)."""
    name = queues.parse(keys, stream)
    assert name is not None, stream
    model, job_class, band = name.model, name.job_class, name.band
    script = redis.register_script(queues.SUBMIT_LUA)
    shared = name.node is None
    args = [
        CONSUMER_GROUP,
        maxlen,
        max_waiting,
        "1" if shared else "0",
        keys.newcomers(model),
        model,
    ]
    args += [part for pair in fields.items() for part in pair]
    room = keys.waiting_room(model, tenant, job_class, band)
    ring = keys.waiting_keys(model, job_class, band)
    counted = queues.class_waiting(keys, model, job_class)
    where, found = await script(keys=[stream, room, ring, *counted], args=args)
    if not where:
        raise QueueFull(
            f"{int(found)} {job_class} requests are waiting for model {model} "
            f"(queue_max_waiting is {max_waiting})",
            retry_after_s=RETRY_AFTER_S,
        )
    return where.decode(), found.decode()


async def _position(
    redis: aioredis.Redis, keys: Keys, stream: str, entry_id: str, *, take_back: bool
) -> int:
    script = redis.register_script(queues.QUEUE_POSITION_LUA)
    waiting_room = "1" if queues.is_waiting_room(stream) else "0"
    for where in queues.homes(stream):
        ahead = queues.streams_before(keys, where)
        args = [entry_id, CONSUMER_GROUP, POSITION_CAP, "1" if take_back else "0", waiting_room]
        if place := int(await script(keys=[where, *ahead], args=args)):
            return place
    return 0


async def position(redis: aioredis.Redis, keys: Keys, stream: str, entry_id: str) -> int:
    """0 once a node has read the job; else 1 + the jobs nodes will read before it."""
    return await _position(redis, keys, stream, entry_id, take_back=False)


async def withdraw(redis: aioredis.Redis, keys: Keys, stream: str, entry_id: str) -> bool:
    """Delete the job's entry if no node has read it yet; True if it was withdrawn."""
    return bool(await _position(redis, keys, stream, entry_id, take_back=True))
