"""Where a waiting job stands in the queues, and taking back a job nobody has read yet (the
per-model summary behind `GET /v1/queue` is `shared.fleet.Fleet.queues`). One Lua script per
question, so each answer is one atomic round trip (scripts in shared/queues.py). A job asks through
`Job.position` (gateway/jobs/job.py); background responses and batch lines, which keep only the
entry's id, ask here."""

import redis.asyncio as aioredis

from shared import queues
from shared.keys import CONSUMER_GROUP, Keys

POSITION_CAP = 10_000  # positions are counted exactly up to this many jobs ahead


async def _position(
    redis: aioredis.Redis, keys: Keys, stream: str, entry_id: str, *, take_back: bool
) -> int:
    script = redis.register_script(queues.QUEUE_POSITION_LUA)
    for where in queues.homes(stream):
        ahead = queues.streams_before(keys, where)
        args = [entry_id, CONSUMER_GROUP, POSITION_CAP, "1" if take_back else "0"]
        if place := int(await script(keys=[where, *ahead], args=args)):
            return place
    return 0


async def position(redis: aioredis.Redis, keys: Keys, stream: str, entry_id: str) -> int:
    """0 once a node has read the job; else 1 + the jobs nodes will read before it."""
    return await _position(redis, keys, stream, entry_id, take_back=False)


async def withdraw(redis: aioredis.Redis, keys: Keys, stream: str, entry_id: str) -> bool:
    """Delete the job's entry if no node has read it yet; True if it was withdrawn."""
    return bool(await _position(redis, keys, stream, entry_id, take_back=True))
