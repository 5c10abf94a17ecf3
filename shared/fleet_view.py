"""A gateway's view of the fleet, kept current from the nodes' heartbeats so that no request reads
the whole fleet (design section 9): every live node's heartbeat in memory, and which nodes hold
each model.

It is built once from the heartbeat hashes (`Keys.node`), then follows the change stream
(`Keys.fleet_changes`, node_agent/serving/heartbeat_writer.py): each entry carries the fields one
heartbeat changed and the node's `seq`; an entry that does not follow the last one the view has of
its node (a gap: the stream was trimmed past this view, or the node restarted) makes the view read
that node's hash again. Liveness comes from `Keys.nodes` (one ZRANGEBYSCORE every `poll_s`); a node
first seen there is read whole. A node whose beats stop is left out of every answer at once but kept
`forget_after_s` before it is forgotten, so a node that comes back (its host stalled, or Redis did:
then every node is late together) goes on from its change stream entries, not with a read of its
hash by every gateway at once. `version` counts the changes applied; `fresh` says the view heard
from Redis within `stale_after_s`, and readers (shared/fleet.py) read Redis themselves when not.

    view = FleetView(redis, keys, node_ttl_s=8.0)
    await view.start()
    view.live_nodes(); view.holders("m"); view.version
    await view.sync()  # caught up now: what a reader that must see the latest beats waits for
"""

import asyncio
import logging
import time

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError

from shared.heartbeat import NodeHeartbeat
from shared.keys import Keys
from shared.redis_conn import Outage

log = logging.getLogger(__name__)

POLL_S = 0.5  # liveness read (and the change stream's longest block)
STALE_AFTER_S = 3.0  # a view that has not heard from Redis for this long is not used
FORGET_AFTER_S = 60.0  # a node out of `Keys.nodes`'s live range this long is forgotten


class FleetView:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        node_ttl_s: float,
        poll_s: float = POLL_S,
        stale_after_s: float = STALE_AFTER_S,
        forget_after_s: float = FORGET_AFTER_S,
    ):
        self._redis, self._keys, self._node_ttl_s = redis, keys, node_ttl_s
        self._poll_s, self._stale_after_s = poll_s, stale_after_s
        self._forget_after_s = forget_after_s
        self._fields: dict[str, dict[str, str]] = {}  # node -> its hash as last known
        self._nodes: dict[str, NodeHeartbeat] = {}  # node -> its parsed heartbeat
        self._seen_ms: dict[str, int] = {}  # node -> last heartbeat (`Keys.nodes` score)
        self._absent: dict[str, float] = {}  # node -> monotonic time it left the live range
        self._holders: dict[str, set[str]] = {}  # model -> nodes whose heartbeat lists it
        self._stale: set[str] = set()  # nodes to read whole at the next poll
        self._last_id = "0-0"
        self._heard = -stale_after_s  # monotonic time Redis last answered
        self._task: asyncio.Task | None = None
        self.version = 0

    # ---- reading it ------------------------------------------------------------------------

    @property
    def fresh(self) -> bool:
        return time.monotonic() - self._heard < self._stale_after_s

    def live_nodes(self) -> list[NodeHeartbeat]:
        """Nodes whose last heartbeat is newer than `node_ttl_s`, in name order."""
        since = self._since_ms()
        return [self._nodes[n] for n in sorted(self._nodes) if self._seen_ms.get(n, 0) >= since]

    def holders(self, model: str) -> list[NodeHeartbeat]:
        """Live nodes whose heartbeat lists `model` (in any state), in name order."""
        since = self._since_ms()
        return [
            self._nodes[n]
            for n in sorted(self._holders.get(model, ()))
            if self._seen_ms.get(n, 0) >= since
        ]

    def _since_ms(self) -> int:
        return int((time.time() - self._node_ttl_s) * 1000)

    # ---- keeping it current ----------------------------------------------------------------

    async def start(self) -> None:
        """Read the fleet once (the change stream's position first, so no change falls between),
        then follow it in the background."""
        try:
            await self._bootstrap()
        except (RedisError, OSError) as exc:  # Redis away: the view starts once it answers
            log.warning(
                "fleet view: Redis did not answer (%s); reading nodes from Redis meanwhile", exc
            )
            self._last_id = "0-0"
        self._task = asyncio.create_task(self._follow(), name="fleet-view")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _bootstrap(self) -> None:
        last = await self._redis.xrevrange(self._keys.fleet_changes(), count=1)
        self._last_id = last[0][0].decode() if last else "0-0"
        await self._poll()

    async def sync(self) -> None:
        """Catch up now: the changes written since the view's last read, then who is alive, with
        nodes first seen or out of step read whole. Costs the change stream's new entries and one
        ZRANGEBYSCORE, not a read of every node; safe beside the background follower (an entry
        applied twice is skipped by its `seq`)."""
        reply = await self._redis.xread({self._keys.fleet_changes(): self._last_id}, count=10_000)
        self._take(reply)
        await self._poll()

    def _take(self, reply) -> None:
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self._advance(entry_id.decode())
                self._apply(fields)

    def _advance(self, entry_id: str) -> None:
        """The last change read moves forward only (`sync` and the follower both read)."""
        if _stream_id(entry_id) > _stream_id(self._last_id):
            self._last_id = entry_id

    async def _follow(self) -> None:
        outage = Outage(log, "fleet view")
        polled = time.monotonic()
        while True:
            try:
                if self._last_id == "0-0" and not self._nodes:
                    await self._bootstrap()  # Redis was away at start
                reply = await self._redis.xread(
                    {self._keys.fleet_changes(): self._last_id},
                    block=int(self._poll_s * 1000),
                    count=1000,
                )
                self._take(reply)
                if time.monotonic() - polled >= self._poll_s:
                    await self._poll()
                    polled = time.monotonic()
                outage.ok()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: readers fall back once the view is stale
                outage.failed(exc)
                await asyncio.sleep(self._poll_s)

    def _apply(self, entry: dict[bytes, bytes]) -> None:
        """One change entry: merged if it follows what the view has of its node, else the node is
        read whole at the next poll."""
        fields = {k.decode(): v.decode() for k, v in entry.items()}
        node = fields.pop("node", "")
        known = self._fields.get(node)
        if known is None or known.get("started_ms") != fields.get("started_ms"):
            self._stale.add(node)
            return
        seq, had = int(fields.get("seq", 0)), int(known.get("seq", 0))
        if seq <= had:
            return  # the view read this already, with the whole hash
        if seq != had + 1:
            self._stale.add(node)
            return
        self._set(node, known | fields)

    async def _poll(self) -> None:
        """Who is alive (`Keys.nodes`), then the nodes first seen or out of step, read whole."""
        since = self._since_ms()
        scored = await self._redis.zrangebyscore(self._keys.nodes(), since, "+inf", withscores=True)
        self._heard = time.monotonic()
        self._seen_ms = {name.decode(): int(score) for name, score in scored}
        for name, beat in self._nodes.items():  # a beat that changed nothing is as new as its score
            beat.heartbeat_ms = max(beat.heartbeat_ms, self._seen_ms.get(name, 0))
        now = time.monotonic()
        for name in self._seen_ms:
            self._absent.pop(name, None)
        for gone in set(self._nodes) - set(self._seen_ms):
            if now - self._absent.setdefault(gone, now) >= self._forget_after_s:
                self._forget(gone)
        wanted = sorted(
            (set(self._seen_ms) - set(self._nodes)) | (self._stale & set(self._seen_ms))
        )
        self._stale -= set(wanted)  # an absent node out of step is read when it is back
        if not wanted:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in wanted:
                pipe.hgetall(self._keys.node(name))
            hashes = await pipe.execute()
        for name, raw in zip(wanted, hashes):
            if raw:
                self._set(name, {k.decode(): v.decode() for k, v in raw.items()})

    def _set(self, node: str, fields: dict[str, str]) -> None:
        try:
            beat = NodeHeartbeat.from_hash({k.encode(): v.encode() for k, v in fields.items()})
        except (ValidationError, ValueError, KeyError) as exc:
            log.warning("ignoring node %s: unreadable heartbeat: %s", node, exc)
            self._stale.add(node)
            return
        old = self._nodes.get(node)
        for model in set(old.models if old else ()) - set(beat.models):
            self._holders.get(model, set()).discard(node)
        for model in beat.models:
            self._holders.setdefault(model, set()).add(node)
        self._fields[node], self._nodes[node] = fields, beat
        self._seen_ms[node] = max(self._seen_ms.get(node, 0), beat.heartbeat_ms)
        self.version += 1

    def _forget(self, node: str) -> None:
        self._absent.pop(node, None)
        self._stale.discard(node)
        beat = self._nodes.pop(node, None)
        self._fields.pop(node, None)
        for model in beat.models if beat else ():
            self._holders.get(model, set()).discard(node)
        self.version += 1


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
