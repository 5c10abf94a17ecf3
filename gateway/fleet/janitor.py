"""The fleet janitor: every `janitor_interval_s` one gateway replica (whoever holds
`cortex:lock:janitor`) repairs what no request is around to notice:

- jobs a dead node had read: a streaming one that had sent a token (`Keys.started`) ends with a
  `node_lost` error event (its client has seen tokens that cannot be taken back); any other goes
  back on its stream once (`retries` field), so its client only waits longer; the dead consumer
  and its note of started jobs are then deleted;
- jobs routed to a node's own stream (gateway/fleet/routing.py) that waited there longer than
  `affinity_wait_ms`, or whose node is dead, draining or without the model, go to the moved stream
  every node reads, keeping their place (`shared.queues.MOVE_LUA`); a gone node's own streams are
  deleted once empty;
- models with jobs waiting and no live replica are placed again, and replicas are added where
  the queue per replica passes `scale_out_queue_depth` or `min_replicas` asks for more;
- whatever else the server hands it as `sweeps` runs on the same beat: background responses
  whose job ended are stored (gateway/jobs/background.py).

An error event the janitor sends goes to the job's event log too (if it has one), so a client
resuming the job learns how it ended.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from redis.exceptions import LockError, RedisError, ResponseError

from gateway.fleet.placement import Placer
from shared import queues, recovery
from shared.errors import ModelUnavailable
from shared.heartbeat import NodeHeartbeat
from shared.keys import CONSUMER_GROUP
from shared.redis_conn import Outage, atomic
from shared.wire import ErrorEvent

log = logging.getLogger(__name__)

SCAN_COUNT = 1000  # keys a SCAN step looks at (Redis's default, 10, is a round trip per 10 keys)


class Janitor:
    def __init__(self, placer: Placer, sweeps: Sequence[Callable[[], Awaitable[None]]] = ()):
        """`placer` holds what the janitor reads and writes (Redis, the catalogue, the fleet) and
        places models again; `sweeps` are the upper layers' own chores, run after the fleet's."""
        self.placer, self.sweeps = placer, sweeps
        self.redis, self.keys, self.settings = placer.redis, placer.keys, placer.settings
        self.catalog, self.fleet = placer.catalog, placer.fleet
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="janitor")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        interval = self.settings.janitor_interval_s
        outage = Outage(log, "janitor")
        while True:
            await asyncio.sleep(interval)
            try:
                lock = self.redis.lock(self.keys.janitor_lock(), timeout=max(5 * interval, 5))
                if await lock.acquire(blocking=False):
                    try:
                        await self.sweep()
                    finally:  # a lock that expired mid-sweep, or Redis away: it expires by itself
                        with contextlib.suppress(RedisError, OSError):  # (a cancel stays one)
                            await lock.release()
                outage.ok()
            except (RedisError, OSError) as exc:
                outage.failed(exc)
            except Exception:
                log.exception("janitor round failed")

    async def sweep(self) -> None:
        nodes = await self.fleet.live_nodes()
        by_name = {n.node: n for n in nodes}
        streams = [
            k.decode()
            async for k in self.redis.scan_iter(match=self.keys.all_jobs(), count=SCAN_COUNT)
        ]
        consumers, lengths = await self._survey(streams)
        dead = set()
        for stream, found, length in zip(streams, consumers, lengths):
            dead |= await self._reap_dead_consumers(stream, found, set(by_name))
            name = queues.parse(self.keys, stream)
            if name is not None and name.node is not None and (length or name.node not in by_name):
                await self._move_waiting(stream, name, by_name.get(name.node))
        if dead:
            await self.redis.delete(*[self.keys.started(node) for node in dead])
        profiles = list(self.catalog.profiles.values())
        waiting = await asyncio.gather(*(self._waiting(p.id, nodes) for p in profiles))
        for profile, queued in zip(profiles, waiting):
            await self._keep_replicas(profile, nodes, queued)
        for sweep in self.sweeps:
            await sweep()

    def _fail(self, pipe, fields: dict[bytes, bytes], error: ErrorEvent) -> None:
        recovery.fail_job(pipe, self.keys, fields, error, self.settings.stream_retention_s)

    async def _survey(self, streams: list[str]) -> tuple[list, list[int]]:
        """Each stream's consumers (XINFO CONSUMERS; none without a group) and length, in one
        pipelined round trip rather than two a stream."""
        if not streams:
            return [], []
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xinfo_consumers(stream, CONSUMER_GROUP)
                pipe.xlen(stream)
            replies = await pipe.execute(raise_on_error=False)
        consumers = [[] if isinstance(r, ResponseError) else r for r in replies[0::2]]
        for r in replies:
            if isinstance(r, Exception) and not isinstance(r, ResponseError):
                raise r
        return consumers, [r if isinstance(r, int) else 0 for r in replies[1::2]]

    async def _reap_dead_consumers(self, stream: str, consumers: list, live: set[str]) -> set[str]:
        """Recover what dead consumers of `stream` had read, and delete them; returns their names."""
        dead = set()
        for consumer in consumers:
            name = (
                consumer["name"].decode()
                if isinstance(consumer["name"], bytes)
                else consumer["name"]
            )
            if name in live:
                continue
            await recovery.recover_consumer(
                self.redis, self.keys, stream, name, self.settings.stream_retention_s
            )
            dead.add(name)
            log.info("removed dead consumer %s from %s", name, stream)
        return dead

    async def _move_waiting(
        self, stream: str, name: queues.StreamName, node: NodeHeartbeat | None
    ) -> None:
        """Move what waits on a node's own stream to the moved stream: all of it when the node is gone,
        draining or without the model (then the stream goes once empty), else what waited too long."""
        serving = node is not None and node.takes_jobs and node.serves(name.model)
        newest = str(int(time.time() * 1000) - self.settings.affinity_wait_ms) if serving else "+"
        script = self.redis.register_script(queues.MOVE_LUA)
        moved = await script(
            keys=[stream, self.keys.moved_jobs(name.model, name.job_class, name.band)],
            args=[CONSUMER_GROUP, newest, 1000, "0" if node is not None else "1"],
        )
        if moved:
            await self.redis.hincrby(self.keys.routing(name.model), "moved", moved)
            log.info(
                "moved %d jobs from %s (%s)",
                moved,
                stream,
                "waited too long" if serving else "node gone",
            )

    async def _keep_replicas(self, profile, nodes: list[NodeHeartbeat], waiting: int) -> None:
        """`nodes`: the live nodes as this sweep read them (once for every model: a fleet of 100 nodes
        and 100 models would parse 10,000 heartbeats a second otherwise); read again to place.
        `waiting`: the model's jobs nobody has read yet."""
        if self._replicas_missing(profile, waiting, nodes) == 0:
            return
        try:
            async with self.redis.lock(
                self.keys.placement_lock(profile.id), timeout=30, blocking_timeout=0.1
            ):
                replicas = self._replicas_missing(
                    profile, waiting, await self.fleet.live_nodes()
                )  # under the lock
                if replicas == 0:
                    return
                node = await self.placer.place(profile, extra_replica=replicas < 0)
                log.info(
                    "janitor placed a replica of %s on %s (%d waiting)", profile.id, node, waiting
                )
        except LockError:  # another gateway is placing it right now
            return
        except ModelUnavailable as exc:
            if waiting and not await self.fleet.is_served(profile.id, fresh=True):
                await self._fail_waiting(profile.id, exc)

    def _replicas_missing(self, profile, waiting: int, nodes: list[NodeHeartbeat]) -> int:
        """0: enough replicas; 1: none and one is needed; -1: some, and one more is needed."""
        replicas = [n for n in nodes if n.takes_jobs and n.serves(profile.id)]
        wanted = max(profile.min_replicas, 1 if waiting else 0)
        if replicas and waiting > self.settings.scale_out_queue_depth * len(replicas):
            wanted = len(replicas) + 1
        if len(replicas) >= min(wanted, profile.max_replicas):
            return 0
        return -1 if replicas else 1

    async def _waiting(self, model: str, nodes: list[NodeHeartbeat]) -> int:
        """Entries of any class nobody has read yet (on the own streams of its nodes too)."""
        serving = tuple(n.node for n in nodes if n.serves(model))
        return sum(
            (await queues.depth(self.redis, self.keys, model, nodes=serving))["queued"].values()
        )

    async def _fail_waiting(self, model: str, error: ModelUnavailable) -> None:
        """No node can serve `model` any more: tell the jobs waiting for it, on its streams and in its
        waiting rooms (none of them is pending)."""
        rooms = [
            room.decode()
            for _job_class, ring in queues.rings(self.keys, model)
            for room in await self.redis.lrange(ring, 0, -1)
        ]
        for stream in [s for _, s in queues.streams(self.keys, model)] + rooms:
            for entry_id, fields in await self.redis.xrange(stream, count=1000):
                async with atomic(self.redis) as pipe:
                    self._fail(pipe, fields, ErrorEvent(code=error.code, message=error.message))
                    pipe.xdel(stream, entry_id)
                    await pipe.execute()
        if rooms:
            await self.redis.delete(*rooms, *(r for _, r in queues.rings(self.keys, model)))
        log.warning("failed the jobs waiting for %s: %s", model, error.message)
