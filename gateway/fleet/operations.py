"""What an operator can ask of the fleet: load, unload, pull, remove files, pin, drain. Used by the
admin routes and the `cortex models`/`cortex drain` commands alike, through the placer (which holds
the fleet, the catalogue and the nodes' command streams). An operator's command is rare and must
reach every node live now, so it reads the heartbeats from Redis, not the gateway's fleet view
(which sees a node that joined within its poll interval only after it)."""

import asyncio

from gateway.fleet.placement import Placer, allowed
from shared.errors import InsufficientCapacity, InvalidRequest, NotFound
from shared.model_store import HUB_PREFIX, HubRef


async def load(placer: Placer, model: str, node: str | None = None) -> str:
    """Load a replica of `model` (on `node`, or where placement puts it); returns the node."""
    profile = placer.catalog.resolve(model)
    async with placer.redis.lock(
        placer.keys.placement_lock(profile.id), timeout=30, blocking_timeout=40
    ):
        if node is None:
            return await placer.place(
                profile, extra_replica=await placer.fleet.is_served(profile.id, fresh=True)
            )
        if await placer.fleet.node(node) is None:
            raise NotFound(f"node {node} has no live heartbeat")
        await placer.send(node, "load", profile.id)
        return node


async def unload(placer: Placer, model: str, node: str | None = None) -> list[str]:
    """Unload `model` from `node`, or from every node holding it; returns those nodes."""
    profile = placer.catalog.resolve(model)
    holders = [
        n.node
        for n in await placer.fleet.live_nodes(fresh=True)
        if profile.id in n.models and node in (None, n.node)
    ]
    await asyncio.gather(*(placer.send(n, "unload", profile.id) for n in holders))
    return holders


def hub_folder(profile) -> str:
    """The models-directory folder of an `hf:` model; InvalidRequest for any other source."""
    if not profile.source.startswith(HUB_PREFIX):
        raise InvalidRequest(
            f"{profile.id} comes from {profile.source}, not from a hub (hf:org/name): "
            "nodes have no files of it to pull or delete"
        )
    return HubRef.parse(profile.source).folder


async def pull(placer: Placer, model: str) -> list[str]:
    """Ask every live node that may run `model` to fetch its files (from a peer, else the hub); returns them."""
    profile = placer.catalog.resolve(model)
    hub_folder(profile)
    nodes = [n.node for n in await placer.fleet.live_nodes(fresh=True) if allowed(profile, n)]
    if not nodes:
        raise InsufficientCapacity(
            f"no live node may run {profile.id} (allowed nodes: {profile.nodes or 'any'}; "
            f"labels: {profile.labels or 'none'})"
        )
    await asyncio.gather(*(placer.send(n, "pull", profile.id) for n in nodes))
    return nodes


async def remove_files(placer: Placer, model: str, node: str | None = None) -> list[str]:
    """Ask the live nodes holding `model`'s files (or `node` only) to delete them (each keeps them if it
    has the model loaded, pinned or being pulled); returns the nodes asked."""
    profile = placer.catalog.resolve(model)
    live = [n for n in await placer.fleet.live_nodes(fresh=True) if node in (None, n.node)]
    holders = await placer.fleet.file_holders(hub_folder(profile), live)
    await asyncio.gather(*(placer.send(n, "rm", profile.id) for n in holders))
    return holders


async def set_pin(placer: Placer, model: str, pinned: bool) -> None:
    profile = placer.catalog.resolve(model)
    await placer.fleet.set_pin(profile.id, pinned)


async def drain(placer: Placer, node: str) -> None:
    if await placer.fleet.node(node) is None:
        raise NotFound(f"node {node} has no live heartbeat")
    await placer.send(node, "drain")
