"""Placement: which node runs a model. Policy lives here, in the gateway; nodes only obey
`load`/`unload` commands. Decisions are taken under a per-model Redis lock, so gateway
replicas placing at once agree, and a replica counts from the moment its node says `loading`."""

import asyncio
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from shared import queues
from shared.catalog import Catalog, ModelProfile
from shared.errors import InsufficientCapacity, ModelLoadFailed
from shared.fleet import Fleet, describe
from shared.heartbeat import NodeHeartbeat
from shared.keys import Keys
from shared.lifecycle import ModelState
from shared.memory import estimate_mb
from shared.model_files import ModelLoadError
from shared.model_store import HUB_PREFIX, HubRef
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 30.0
ACK_TIMEOUT_S = 10.0  # how long a node may take to show `loading` after a load command


@dataclass
class Plan:
    node: str
    evict: list[str]
    free_mb: int  # free on the node once the evictions are done
    wakes: bool = False  # the model sleeps there: a load wakes it


@dataclass
class Candidate:
    node: NodeHeartbeat
    free_mb: int
    evictable: list[str]  # idle, unpinned models, in eviction order
    must_evict: list[str] = field(
        default_factory=list
    )  # the node's tensor-parallel model, for another one
    asleep: bool = False  # the node holds the model sleeping: waking it needs no more memory


def allowed(profile: ModelProfile, node: NodeHeartbeat) -> bool:
    return (
        node.takes_jobs
        and (not profile.nodes or node.node in profile.nodes)
        and set(profile.labels) <= set(node.labels)
        and (profile.tensor_parallel == 1 or len(node.devices) >= profile.tensor_parallel)
    )


def room_mb(profile: ModelProfile, node: NodeHeartbeat, evicted: list[str]) -> int:
    """Free memory for one share of the model once `evicted` are gone: on the node's emptiest
    device, or for a model sharded over N devices the N-th emptiest. An evicted model frees its
    share on each device it holds."""
    free = {d.id: d.free_mb for d in node.devices}
    for model in evicted:
        info = node.models[model]
        held_on = info.devices or [info.device]
        for device in held_on:
            if device in free:
                free[device] += info.memory_mb // len(held_on)
    ranked = sorted(free.values(), reverse=True)
    return ranked[profile.tensor_parallel - 1] if len(ranked) >= profile.tensor_parallel else 0


def sharded_models(node: NodeHeartbeat) -> list[str]:
    """The tensor-parallel model a node agent holds: one at a time (it owns the process group)."""
    return [
        m
        for m, info in node.models.items()
        if len(info.devices) > 1 and info.state != ModelState.FAILED
    ]


def candidates(
    profile: ModelProfile,
    nodes: list[NodeHeartbeat],
    pinned: set[str],
    busy: set[str],
    priority: dict[str, int],
    strategy: str,
) -> list[Candidate]:
    """Allowed nodes not yet serving `profile` (those where it sleeps among them), each with what
    it could free for it: its sleeping models first, then its idle ready ones. A tensor-parallel
    model goes only where the node's own tensor-parallel model (if any) is idle, and evicts it."""
    found = []
    for node in nodes:
        held = node.models.get(profile.id)
        asleep = held is not None and held.state == ModelState.SLEEPING
        if not allowed(profile, node) or (held is not None and not asleep):
            continue
        idle = [
            m
            for m, info in node.models.items()
            if m != profile.id
            and (
                info.state == ModelState.SLEEPING
                or (info.state == ModelState.READY and info.slots_used == 0)
            )
            and m not in pinned
            and m not in busy
        ]

        def awake(m: str) -> bool:
            return node.models[m].state != ModelState.SLEEPING

        order = (
            (lambda m: (awake(m), priority.get(m, 0), node.models[m].last_used_ms))
            if strategy == "priority"
            else (lambda m: (awake(m), node.models[m].last_used_ms))
        )
        must_evict = sharded_models(node) if profile.tensor_parallel > 1 else []
        if any(m not in idle for m in must_evict):
            continue
        found.append(
            Candidate(
                node,
                room_mb(profile, node, must_evict),
                [m for m in sorted(idle, key=order) if m not in must_evict],
                must_evict,
                asleep,
            )
        )
    return found


def plan(
    profile: ModelProfile,
    need_mb: int,
    found: list[Candidate],
    fleet_summary: str = "",
    holding: frozenset[str] = frozenset(),
) -> Plan:
    """A node where the model sleeps (waking it loads nothing), then one that holds the model's files
    already (`holding`: no download), then the one needing the fewest evictions, then with the most
    room left; 503 when none fits."""
    plans = []
    for c in found:
        if c.asleep:
            plans.append(Plan(c.node.node, [], c.free_mb, wakes=True))
            continue
        free, evict = c.free_mb, list(c.must_evict)
        for model in c.evictable:
            if free >= need_mb:
                break
            evict.append(model)
            free = room_mb(profile, c.node, evict)
        if free >= need_mb:
            plans.append(Plan(c.node.node, evict, free - need_mb))
    if plans:
        return min(
            plans, key=lambda p: (not p.wakes, p.node not in holding, len(p.evict), -p.free_mb)
        )
    if not found:
        devices = (
            f"; {profile.tensor_parallel} devices on one node, whose tensor-parallel model if any is idle"
            if profile.tensor_parallel > 1
            else ""
        )
        raise InsufficientCapacity(
            f"no live node may run {profile.id} "
            f"(allowed nodes: {profile.nodes or 'any'}; labels: {profile.labels or 'none'}"
            f"{devices}); live nodes: {fleet_summary}"
        )
    best = max(found, key=lambda c: room_mb(profile, c.node, c.must_evict + c.evictable))
    could = room_mb(profile, best.node, best.must_evict + best.evictable)
    per_device = (
        f" on each of {profile.tensor_parallel} devices" if profile.tensor_parallel > 1 else ""
    )
    raise InsufficientCapacity(
        f"{profile.id} needs {need_mb} MB{per_device}; the best candidate, {best.node.node}, has {best.free_mb} MB "
        "free "
        f"and {could - best.free_mb} MB in idle unpinned models ({', '.join(best.evictable) or 'none'})"
    )


class Placer:
    """Where a model goes when no live node serves it (under its placement lock), and the load,
    unload and other commands sent to a node's command stream."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: GatewaySettings,
        catalog: Catalog,
        fleet: Fleet,
    ):
        self.redis, self.keys, self.settings, self.catalog, self.fleet = (
            redis,
            keys,
            settings,
            catalog,
            fleet,
        )

    async def warm_up(self) -> None:
        """Estimate every catalogue model's memory once, off the request path (reading a GGUF
        header takes seconds)."""
        for profile in self.catalog.profiles.values():
            try:
                await asyncio.to_thread(estimate_mb, profile)
            except (
                Exception
            ) as exc:  # a model whose files are not on this host is estimated later, or not
                log.info("no memory estimate for %s here: %s", profile.id, exc)

    async def pinned(self) -> set[str]:
        overrides = await self.fleet.pins()
        return {m for m, p in self.catalog.profiles.items() if overrides.get(m, p.pin)}

    async def _busy(self, models: list[str]) -> set[str]:
        """Of `models`, those with jobs waiting in their streams or waiting rooms (never evicted
        from under them)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for m in models:
                for _job_class, stream in queues.streams(self.keys, m):
                    pipe.xlen(stream)
                for _job_class, ring in queues.rings(self.keys, m):
                    pipe.llen(ring)
            lengths = iter(await pipe.execute())
        per_model = len(queues.streams(self.keys, "")) + len(queues.rings(self.keys, ""))
        return {m for m in models if sum(next(lengths) for _ in range(per_model))}

    async def ensure_placed(self, profile: ModelProfile) -> None:
        """Make sure a live node has `profile` ready or loading; place it if none has."""
        if await self.fleet.is_served(profile.id):
            return
        async with self.redis.lock(
            self.keys.placement_lock(profile.id),
            timeout=LOCK_TIMEOUT_S,
            blocking_timeout=LOCK_TIMEOUT_S + ACK_TIMEOUT_S,
        ):
            if not await self.fleet.is_served(profile.id, fresh=True):
                await self.place(profile)

    async def place(self, profile: ModelProfile, *, extra_replica: bool = False) -> str:
        """Choose a node (evicting idle models if needed), send `load`, wait for it to say `loading`.
        Call it holding the model's placement lock. The fleet view first; where it finds no room,
        the view caught up with every beat Redis took (it sees a node that joined within its poll
        interval, half a second, only after it)."""
        try:
            return await self._place(profile, await self.fleet.live_nodes(), extra_replica)
        except InsufficientCapacity:
            nodes = await self.fleet.live_nodes(fresh=True)
            return await self._place(profile, nodes, extra_replica)

    async def _place(
        self, profile: ModelProfile, nodes: list[NodeHeartbeat], extra_replica: bool
    ) -> str:
        failed = [
            n
            for n in nodes
            if n.models.get(profile.id) and n.models[profile.id].state == ModelState.FAILED
        ]
        strategy = self.settings.eviction_strategy
        priority = {m: p.priority for m, p in self.catalog.profiles.items()}
        pinned = await self.pinned()
        found = candidates(profile, nodes, pinned, set(), priority, strategy)
        evictable = sorted({m for c in found for m in c.evictable + c.must_evict})
        if busy := await self._busy(evictable):  # only what a candidate could evict is looked at
            found = candidates(profile, nodes, pinned, busy, priority, strategy)
        wakes = any(c.asleep for c in found)  # then that plan is chosen: nothing to estimate
        need = await self._estimate_mb(profile) if found and not wakes else 0  # on each device
        holding = frozenset(
            await self.fleet.file_holders(
                HubRef.parse(profile.source).folder, [c.node for c in found]
            )
            if profile.source.startswith(HUB_PREFIX)
            else []
        )
        try:
            chosen = plan(profile, need, found, describe(nodes), holding)
        except InsufficientCapacity:
            if failed and not extra_replica:
                raise ModelLoadFailed(
                    f"{profile.id} failed to load on {failed[0].node}: "
                    f"{failed[0].models[profile.id].error}"
                ) from None
            raise
        for model in chosen.evict:
            log.info("evicting %s from %s for %s (%s)", model, chosen.node, profile.id, strategy)
            await self.send(chosen.node, "unload", model)
        if chosen.wakes:
            log.info("waking %s on %s", profile.id, chosen.node)
        else:
            log.info(
                "placing %s (%d MB on each of %d devices) on %s",
                profile.id,
                need,
                profile.tensor_parallel,
                chosen.node,
            )
        await self.send(chosen.node, "load", profile.id)
        await self._await_loading(chosen.node, profile.id)
        return chosen.node

    @staticmethod
    async def _estimate_mb(profile: ModelProfile) -> int:
        try:
            return await asyncio.to_thread(estimate_mb, profile)
        except (
            ModelLoadError
        ) as exc:  # an `hf:` model the nodes pull, whose files this host does not have
            raise InsufficientCapacity(
                f"{profile.id} has no memory_mb in the catalogue and its files are not on the "
                f"gateway's host to estimate it from ({exc}); set memory_mb"
            ) from exc

    async def send(self, node: str, cmd: str, model: str = "") -> None:
        await self.fleet.command(node, cmd, model, by=f"gateway:{self.settings.port}")

    async def _await_loading(self, node: str, model: str) -> None:
        """Until the node says `loading` (or further): a model sleeping there is woken first."""
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while time.monotonic() < deadline:
            held = (await self.fleet.node(node) or NodeHeartbeat.empty(node)).models.get(model)
            if held is not None and held.state != ModelState.SLEEPING:
                return
            await asyncio.sleep(0.05)
        log.warning("%s did not show %s loading within %.0f s", node, model, ACK_TIMEOUT_S)
