"""The queues as the gateway sees them: where a waiting job stands, taking back a job nobody has
read yet, and the per-model summary behind `GET /v1/queue`. One Lua script per question, so each
answer is one atomic round trip (scripts in shared/queues.py)."""

import redis.asyncio as aioredis

from gateway.context import GatewayContext
from shared import queues
from shared.keys import CONSUMER_GROUP, Keys

POSITION_CAP = 10_000  # positions are counted exactly up to this many jobs ahead


async def _position(redis: aioredis.Redis, keys: Keys, stream: str, entry_id: str, *, take_back: bool) -> int:
    model = queues.model_of(keys, stream) or ""
    script = redis.register_script(queues.QUEUE_POSITION_LUA)
    ahead = queues.streams_before(keys, model, stream)
    return int(await script(keys=[stream, *ahead], args=[entry_id, CONSUMER_GROUP, POSITION_CAP, "1" if take_back else "0"]))


async def position(ctx: GatewayContext, stream: str, entry_id: str) -> int:
    """0 once a node has read the job; else 1 + the jobs nodes will read before it."""
    return await _position(ctx.redis, ctx.keys, stream, entry_id, take_back=False)


async def withdraw(ctx: GatewayContext, stream: str, entry_id: str) -> bool:
    """Delete the job's entry if no node has read it yet; True if it was withdrawn."""
    return bool(await _position(ctx.redis, ctx.keys, stream, entry_id, take_back=True))


async def summary(ctx: GatewayContext) -> list[dict]:
    """Per model (catalogue and live ones): queued jobs by class, running jobs, replicas, oldest wait."""
    nodes = await ctx.fleet.live_nodes()
    models = set(ctx.catalog.profiles) | {m for node in nodes for m in node.models}
    script = ctx.redis.register_script(queues.QUEUE_STATS_LUA)
    found = []
    for model in sorted(models):
        pairs = queues.streams(ctx.keys, model)
        reply = await script(keys=[s for _, s in pairs], args=[CONSUMER_GROUP])
        replicas = sum(1 for node in nodes if node.serves(model) and node.state != "draining")
        found.append(queues.summarize(model, [c for c, _ in pairs], reply, replicas))
    return found
