"""The fleet as Redis holds it, read once for everyone: the gateway (placement, `/v1/queue`,
errors), the batch worker and `cortex status`. Nodes come from heartbeats (`cortex:nodes` zset of
node → last heartbeat ms; `cortex:node:{node}` hashes); queues from one Lua script per model
(shared/queues.py), all sent at once. The fleet operations that are plain Redis commands live
here too: a command to one node (`cortex:cmd:{node}`) and a model's pin (`cortex:pins`)."""

import asyncio
import logging
import time

import redis.asyncio as aioredis
from pydantic import ValidationError

from shared import queues
from shared.commands import NodeCommand
from shared.fleet_status import CatalogModelStatus, FleetStatus, NodeStatus, QueueStatus
from shared.fleet_view import FleetView
from shared.heartbeat import NodeHeartbeat
from shared.keys import Keys
from shared.lifecycle import ModelState

log = logging.getLogger(__name__)

SERVED_CACHE_S = 1.0  # a positive answer of `is_served` is reused this long; a negative never
COMMANDS_KEPT = 1000  # MAXLEN ~ of a node's command stream


class Fleet:
    def __init__(
        self, redis: aioredis.Redis, keys: Keys, node_ttl_s: float, view: FleetView | None = None
    ):
        """`view`: the gateway's fleet view (shared/fleet_view.py); while it is fresh the live nodes
        and a model's replicas come from it, and no request reads the nodes' hashes."""
        self._redis = redis
        self._keys = keys
        self._node_ttl_s = node_ttl_s
        self.view = view
        self._served_until: dict[str, float] = {}  # model id -> monotonic deadline

    async def _heartbeats(self, names: list[bytes]) -> list[NodeHeartbeat | None | ValueError]:
        """Each named node's heartbeat; None where its hash is gone, the error where it is unreadable."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(self._keys.node(name.decode()))
            hashes = await pipe.execute()
        found = []
        for fields in hashes:
            try:
                found.append(NodeHeartbeat.from_hash(fields) if fields else None)
            except (ValidationError, ValueError) as exc:
                found.append(ValueError(str(exc).splitlines()[0]))
        return found

    async def live_nodes(self, *, fresh: bool = False) -> list[NodeHeartbeat]:
        """Nodes whose last heartbeat is newer than `node_ttl_s`, in name order: the view's, while
        it is fresh; `fresh`: every beat Redis took so far (the view caught up first, or, with none,
        the hashes read).  Readers that answer what a caller just changed (a model it loaded, a node
        it started) ask for `fresh`; a request's routing does not."""
        if view := await self._usable_view(fresh):
            return view.live_nodes()
        return await self._read_live_nodes()

    async def _usable_view(self, fresh: bool) -> FleetView | None:
        """The view while it is fresh (caught up with every beat Redis took first, with `fresh`);
        None: read Redis."""
        if self.view is None or not self.view.fresh:
            return None
        if fresh:
            await self.view.sync()
        return self.view

    async def _read_live_nodes(self) -> list[NodeHeartbeat]:
        """`live_nodes` as Redis holds them now: every live node's hash read."""
        since_ms = int((time.time() - self._node_ttl_s) * 1000)
        names = await self._redis.zrangebyscore(self._keys.nodes(), since_ms, "+inf")
        nodes = []
        for name, node in zip(names, await self._heartbeats(names) if names else []):
            if isinstance(node, ValueError):
                log.warning("ignoring node %s: unreadable heartbeat: %s", name.decode(), node)
            elif (
                node is not None and node.heartbeat_ms >= since_ms
            ):  # None: expired or shut down cleanly
                nodes.append(node)
        return sorted(nodes, key=lambda node: node.node)

    async def serving_nodes(self, *, fresh: bool = False) -> list[NodeHeartbeat]:
        """Live nodes that take new jobs (not draining or drained)."""
        return [node for node in await self.live_nodes(fresh=fresh) if node.takes_jobs]

    async def node(self, name: str) -> NodeHeartbeat | None:
        fields = await self._redis.hgetall(self._keys.node(name))
        return NodeHeartbeat.from_hash(fields) if fields else None

    async def is_served(self, model: str, *, fresh: bool = False) -> bool:
        """Some live node taking jobs has `model` ready or loading (a yes is reused for a second;
        `fresh`: not that, every beat Redis took so far)."""
        if not fresh and self._served_until.get(model, 0.0) > time.monotonic():
            return True
        if view := await self._usable_view(fresh):
            return any(n.takes_jobs and n.serves(model) for n in view.holders(model))
        served = any(n.takes_jobs and n.serves(model) for n in await self._read_live_nodes())
        if served:
            self._served_until[model] = time.monotonic() + SERVED_CACHE_S
        return served

    async def file_holders(self, folder: str, nodes: list[NodeHeartbeat]) -> list[str]:
        """Which of `nodes` hold a model folder whole (`Keys.model_files`, shared/model_store.py)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for node in nodes:
                pipe.hexists(self._keys.model_files(node.node), folder)
            held = await pipe.execute() if nodes else []
        return [node.node for node, has in zip(nodes, held) if has]

    # ---- queues ---------------------------------------------------------------------------

    async def queues(self, models: set[str], nodes: list[NodeHeartbeat]) -> list[QueueStatus]:
        """Per model: queued jobs by class (the own streams of `nodes` and the waiting rooms
        too), running jobs, replicas taking jobs, oldest wait (every model's sent at once)."""
        ordered = sorted(models)
        # concurrently, not pipelined: a cluster pipeline cannot run scripts (each model's on its shard)
        replies = await asyncio.gather(
            *(
                queues.depth(
                    self._redis,
                    self._keys,
                    model,
                    replicas=sum(1 for n in nodes if n.serves(model) and n.takes_jobs),
                    nodes=tuple(n.node for n in nodes if n.serves(model)),
                )
                for model in ordered
            ),
            *(self._redis.hgetall(self._keys.routing(model)) for model in ordered),
        )
        depths, routings = replies[: len(ordered)], replies[len(ordered) :]
        return [
            QueueStatus(
                **depth,
                routed={k.decode(): int(v) for k, v in routed.items()},
                prefix_hit_rate=prefix_hit_rate(model, nodes),
            )
            for model, depth, routed in zip(ordered, depths, routings)
        ]

    # ---- everything, for `cortex status` --------------------------------------------------

    async def status(self, now_ms: int | None = None) -> FleetStatus:
        """Every node that ever sent a heartbeat (dead ones marked), every model's queues, and the
        catalogue's models that no live node holds."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        scored = await self._redis.zrange(self._keys.nodes(), 0, -1, withscores=True)
        heartbeats = await self._heartbeats([name for name, _ in scored]) if scored else []
        by_name = sorted(
            zip(scored, heartbeats), key=lambda pair: pair[0][0]
        )  # heartbeats stay with their nodes
        heartbeats = [hb for _, hb in by_name]
        nodes = [
            NodeStatus.of(name.decode(), int(score), hb, node_ttl_s=self._node_ttl_s, now_ms=now_ms)
            for (name, score), hb in by_name
        ]
        catalog = {
            k.decode(): v for k, v in (await self._redis.hgetall(self._keys.catalog())).items()
        }
        models = {m for n in nodes for m in n.models} | set(catalog)
        async for key in self._redis.scan_iter(match=self._keys.all_jobs(), count=500):
            models.add(queues.model_of(self._keys, key.decode()))
        live = [hb for hb, n in zip(heartbeats, nodes) if isinstance(hb, NodeHeartbeat) and n.alive]
        found = await self.queues(models, live)
        depth = {q.model: sum(q.queued.values()) for q in found}
        for n in nodes:
            for name, m in n.models.items():
                m.queue_depth = depth.get(name, 0)
        held = {
            name
            for n in nodes
            if n.alive
            for name, m in n.models.items()
            if m.state != ModelState.FAILED
        }
        not_loaded = [
            CatalogModelStatus.of(model, catalog[model], depth.get(model, 0))
            for model in sorted(set(catalog) - held)
        ]
        return FleetStatus(now_ms=now_ms, nodes=nodes, queues=found, not_loaded=not_loaded)

    # ---- operations that are plain Redis commands ----------------------------------------

    async def command(self, node: str, cmd: str, model: str = "", *, by: str) -> None:
        """Send `load`, `unload` or `drain` to one node (`by`: who asks, for its log)."""
        command = NodeCommand(cmd=cmd, model=model, by=by, sent_ms=int(time.time() * 1000))
        await self._redis.xadd(
            self._keys.cmd(node), command.to_fields(), maxlen=COMMANDS_KEPT, approximate=True
        )

    async def set_pin(self, model: str, pinned: bool) -> None:
        """Override the catalogue's `pin` for `model` fleet-wide."""
        await self._redis.hset(self._keys.pins(), model, "1" if pinned else "0")

    async def pins(self) -> dict[str, bool]:
        """The pin overrides set with `set_pin`."""
        return {
            k.decode(): v == b"1" for k, v in (await self._redis.hgetall(self._keys.pins())).items()
        }


def prefix_hit_rate(model: str, nodes: list[NodeHeartbeat]) -> float | None:
    """The share of prompt tokens `model`'s replicas on `nodes` found in their prefix caches, all
    together (None before any prompt was looked up)."""
    stats = [
        info.kv
        for node in nodes
        if (info := node.models.get(model)) is not None and info.kv is not None
    ]
    queries = sum(kv.prefix_queries for kv in stats)
    return sum(kv.prefix_hits for kv in stats) / queries if queries else None


def describe(nodes: list[NodeHeartbeat]) -> str:
    """`node-a (draining; SmolLM2 poisoned), node-b (no models)` — for error messages."""
    if not nodes:
        return "none (no node agent has sent a recent heartbeat)"
    parts = []
    for node in nodes:
        models = (
            ", ".join(f"{model} {info.state}" for model, info in node.models.items()) or "no models"
        )
        parts.append(f"{node.node} ({'' if node.takes_jobs else f'{node.state}; '}{models})")
    return ", ".join(parts)
