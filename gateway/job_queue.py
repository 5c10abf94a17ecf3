"""The queues as the gateway sees them: where a waiting job stands and taking back a job nobody
has read yet (the per-model summary behind `GET /v1/queue` is `shared.fleet.Fleet.queues`). One Lua
script per question, so each answer is one atomic round trip (scripts in shared/queues.py)."""

import asyncio
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway import sse
from gateway.context import GatewayContext
from shared import queues
from shared.errors import CortexError
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


async def position(ctx: GatewayContext, stream: str, entry_id: str) -> int:
    """0 once a node has read the job; else 1 + the jobs nodes will read before it."""
    return await _position(ctx.redis, ctx.keys, stream, entry_id, take_back=False)


async def withdraw(ctx: GatewayContext, stream: str, entry_id: str) -> bool:
    """Delete the job's entry if no node has read it yet; True if it was withdrawn."""
    return bool(await _position(ctx.redis, ctx.keys, stream, entry_id, take_back=True))


# ---- a streaming client waiting in the queue ----------------------------------------------------

QUEUE_POSITION_HEADER = "x-cortex-queue-position"


async def first_event_or_position(job, first: asyncio.Future) -> int:
    """Wait briefly for the job's first event (0: it came, or a node is already on the job and
    it will come); else return the job's queue position, so the response can start at once. A
    job whose entry is not known here (a resumed one) waits for its first event."""
    ctx = job._ctx
    done, _ = await asyncio.wait({first}, timeout=ctx.settings.queued_after_s)
    if not done and job.entry_id:
        place = await position(ctx, job.stream, job.entry_id)
        if place > 0:
            return place
    await first  # a node has it: the first token is a prefill away; an error before any output is an HTTP status
    return 0


async def queued_frames(
    job,
    first: asyncio.Future,
    place: int,
    frames: AsyncIterator[bytes],
    failed: Callable[[CortexError], AsyncIterator[bytes]],
    notice: Callable[[int], bytes] | None = sse.queued,
) -> AsyncIterator[bytes]:
    """A `notice` of the job's place (SSE comments `: queued position=N`; None: nothing, for a
    framing that has no comments) while the job waits, then the job's own frames (or, if it failed
    before its first token, the dialect's error frames)."""
    ctx = job._ctx
    try:
        while not first.done():
            if place > 0 and notice is not None:
                yield notice(place)
            await asyncio.wait({first}, timeout=ctx.settings.queue_position_poll_s)
            if not first.done() and place > 0:
                try:
                    place = await position(ctx, job.stream, job.entry_id)
                except (
                    RedisError
                ):  # Redis restarting: the job waits on (gateway/events.py), so does its place
                    pass
        try:
            first.result()
        except CortexError as exc:
            async for frame in failed(exc):
                yield frame
            return
        async for frame in frames:
            yield frame
    finally:
        if not first.done():
            first.cancel()
