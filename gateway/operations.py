"""What an operator can ask of the fleet: load, unload, pin, drain. Used by the admin routes and
the `cortex models`/`cortex drain` commands alike."""

import asyncio

from shared.errors import NotFound


async def load(ctx, model: str, node: str | None = None) -> str:
    """Load a replica of `model` (on `node`, or where placement puts it); returns the node."""
    profile = ctx.catalog.resolve(model)
    async with ctx.redis.lock(ctx.keys.placement_lock(profile.id), timeout=30, blocking_timeout=40):
        if node is None:
            return await ctx.placer.place(profile, extra_replica=await ctx.fleet.is_served(profile.id, fresh=True))
        if await ctx.fleet.node(node) is None:
            raise NotFound(f"node {node} has no live heartbeat")
        await ctx.placer.send(node, "load", profile.id)
        return node


async def unload(ctx, model: str, node: str | None = None) -> list[str]:
    """Unload `model` from `node`, or from every node holding it; returns those nodes."""
    profile = ctx.catalog.resolve(model)
    holders = [n.node for n in await ctx.fleet.live_nodes() if profile.id in n.models and node in (None, n.node)]
    await asyncio.gather(*(ctx.placer.send(n, "unload", profile.id) for n in holders))
    return holders


async def set_pin(ctx, model: str, pinned: bool) -> None:
    profile = ctx.catalog.resolve(model)
    await ctx.fleet.set_pin(profile.id, pinned)


async def drain(ctx, node: str) -> None:
    if await ctx.fleet.node(node) is None:
        raise NotFound(f"node {node} has no live heartbeat")
    await ctx.placer.send(node, "drain")
