"""The event router's connections (gateway/bus/router.py): ONE Redis pub/sub connection per gateway
process, or on a Redis Cluster one per shard, to whichever master holds the shard's slots now (a
replica promoted after a failover). Each connection has a reader task that reconnects it with
backoff when it breaks; a broken connection is never hidden (no silent retry of redis-py's own),
since events published while nobody listened are lost and the router must know. What the links
hear, and when they connect and drop, goes to their owner: what that means for a job is its
business, not theirs."""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError, RedisError

from shared.errors import RedisUnreachable
from shared.redis_conn import BACKOFF_MAX_S, cluster_client, is_cluster_url, node_client

log = logging.getLogger(__name__)

CONNECT_WAIT_S = 1.0  # how long a new job waits for a (re)connecting router before a 503
POLL_S = 1.0  # the reader wakes at least this often to check the connection
PING_AFTER_IDLE_S = 5.0  # nothing heard for this long: send a PING
DEAD_AFTER_IDLE_S = 15.0  # not even the PING answered: the connection is dead
BACKOFF_MIN_S = 0.05
WOKEN_AFTER_S = (
    0.1  # a reconnect a waiting request asks for comes no sooner than this after the last try
)


def pubsub_client(url: str) -> aioredis.Redis:
    """A client without redis-py's own retry: a silent reconnect and resubscribe would hide the
    gap during which events were lost, so the router must see every broken connection. On a
    cluster, the cluster's client: its map of the shards (the router connects to each master)."""
    if is_cluster_url(url):
        return cluster_client(url, socket_connect_timeout=2.0, socket_keepalive=True)
    return aioredis.Redis.from_url(url, socket_connect_timeout=2.0, socket_keepalive=True)


async def reconnected(ready: asyncio.Event, wake: asyncio.Event | None = None) -> None:
    """Wait up to `CONNECT_WAIT_S` for a (re)connecting link; RedisUnreachable after that.
    `wake`: cut the link's backoff short (a request is waiting: try again now, not in up to 2 s)."""
    if ready.is_set():
        return
    if wake is not None:
        wake.set()
    try:
        async with asyncio.timeout(CONNECT_WAIT_S):
            await ready.wait()
    except TimeoutError:
        raise RedisUnreachable("Redis is unreachable; the gateway is reconnecting") from None


async def _back_off(delay: float, wake: asyncio.Event) -> None:
    """Sleep `delay`, or less once `wake` is set, but never less than `WOKEN_AFTER_S` (requests
    arriving during an outage make the retries no faster than that)."""
    wake.clear()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay):
            await asyncio.sleep(WOKEN_AFTER_S)
            await wake.wait()


class Link:
    """One pub/sub connection: to the Redis, or to the master that holds one shard's slots."""

    def __init__(self, slot: int | None = None, slots: frozenset[int] = frozenset()):
        self.slot = (
            slot  # a cluster: one slot of its shard (whoever holds it is asked at each connect)
        )
        self.slots = slots  # ... and all of them, as of the last connect
        self.name = "Redis" if slot is None else f"the shard of slot {slot}"
        self.client: aioredis.Redis | None = None
        self.pubsub: PubSub | None = None
        self.connected = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.was_connected = False
        self.wake = (
            asyncio.Event()
        )  # set by a request waiting for this link: retry now (`_back_off`)

    @property
    def sharded(self) -> bool:
        return self.slot is not None


class Owner(Protocol):
    def on_message(self, link: Link, message: dict) -> None: ...
    async def on_link_connected(self, link: Link, reconnect: bool) -> None: ...
    async def on_link_dropped(self, link: Link, why: str) -> None: ...


class Links:
    def __init__(
        self,
        client_factory: Callable[[], aioredis.Redis],
        owner: Owner,
        on_connect: Callable[[], Awaitable[None]] | None = None,
    ):
        self._client_factory, self._owner = client_factory, owner
        self._on_connect = on_connect  # run after every (re)connect, e.g. to rewrite the catalogue
        self.cluster: RedisCluster | None = None  # a cluster's client: its map, and commands
        self.all: list[Link] = []
        self._mapped = (
            asyncio.Event()
        )  # the links exist (at once for one Redis; a cluster's map read)
        self._mapper: asyncio.Task | None = None

    @property
    def connected(self) -> bool:
        return self._mapped.is_set() and all(link.connected.is_set() for link in self.all)

    async def start(self) -> None:
        self._mapper = asyncio.create_task(self._map(), name="cortex-event-router")

    async def stop(self) -> None:
        tasks = [t for t in [self._mapper, *(link.task for link in self.all)] if t is not None]
        while any(not t.done() for t in tasks):
            for task in tasks:
                task.cancel()  # again if need be: Python 3.11's wait_for can swallow a cancel
            await asyncio.wait(tasks, timeout=0.1)

    async def close(self) -> None:
        if self.cluster is not None:
            await self.cluster.aclose()

    def commands(self, link: Link) -> aioredis.Redis | None:
        """The client for ordinary commands about `link`'s keys (a cluster's, routed by slot)."""
        return self.cluster if link.sharded else link.client

    @staticmethod
    async def send(link: Link, command: str, *keys: bytes) -> None:
        """(UN)SUBSCRIBE, or on a cluster SSUBSCRIBE / SUNSUBSCRIBE one channel at a time (the
        channels of one command must share a slot)."""
        if not link.sharded:
            await link.pubsub.execute_command(command, *keys)
            return
        for key in keys:
            await link.pubsub.execute_command("S" + command, key)

    async def link_for(self, key: bytes) -> Link:
        await reconnected(self._mapped)
        if self.cluster is None:
            return self.all[0]
        slot = key_slot(key)
        link = next((link for link in self.all if slot in link.slots), None)
        if link is None:  # a shard this gateway has not met (the cluster grew): read the map again
            self._add(await self._read_map())
            link = next(link for link in self.all if slot in link.slots)
        return link

    async def close_link(self, link: Link) -> None:
        pubsub, client, link.pubsub, link.client = link.pubsub, link.client, None, None
        for closing in (pubsub, client):
            if closing is not None:
                try:
                    await closing.aclose()
                except (RedisError, OSError):
                    pass

    # ---- the map -------------------------------------------------------------------------------

    async def _map(self) -> None:
        """Make the links: one for one Redis, or one per shard of the cluster, once its map is read."""
        first = self._client_factory()
        if not isinstance(first, RedisCluster):
            self._add({None: frozenset()}, first)
            return
        self.cluster, delay = first, BACKOFF_MIN_S
        while True:
            try:
                self._add(await self._read_map())
                return
            except (RedisError, OSError) as exc:
                log.warning(
                    "event router: the Redis Cluster is unreachable (%s); trying again in %.2fs",
                    exc,
                    delay,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _read_map(self) -> dict[int, frozenset[int]]:
        """The cluster's shards now: a slot of each -> all its slots."""
        await self.cluster.nodes_manager.initialize()
        by_master: dict[str, set[int]] = {}
        for slot, nodes in self.cluster.nodes_manager.slots_cache.items():
            by_master.setdefault(nodes[0].name, set()).add(slot)
        return {min(slots): frozenset(slots) for slots in by_master.values()}

    def _add(
        self, shards: dict[int | None, frozenset[int]], client: aioredis.Redis | None = None
    ) -> None:
        """Links to the shards not linked yet (`client`: the one Redis's first client)."""
        for slot, slots in shards.items():
            if slot is not None and any(slot in link.slots for link in self.all):
                continue
            link = Link(slot, slots)
            link.client = client
            link.task = asyncio.create_task(self._run(link), name=f"cortex-event-router-{slot}")
            self.all.append(link)
        self._mapped.set()

    # ---- one link's reader task --------------------------------------------------------------

    async def _run(self, link: Link) -> None:
        delay = BACKOFF_MIN_S
        while True:
            try:
                await self._connect(link)
                delay = BACKOFF_MIN_S
                log.info("event router connected to %s", link.name)
                await self._read(link)
            except (RedisError, OSError) as exc:
                log.warning(
                    "event router: %s unreachable (%s); reconnecting in %.2fs",
                    link.name,
                    exc,
                    delay,
                )
            except Exception:  # never let the router die: every job depends on it
                log.exception("event router: unexpected error; reconnecting in %.2fs", delay)
            link.connected.clear()
            await self._owner.on_link_dropped(
                link, "lost the connection to Redis while the job was running"
            )
            await self.close_link(link)
            await _back_off(delay, link.wake)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _connect(self, link: Link) -> None:
        if (
            link.sharded
        ):  # whoever holds the shard's slots now (a replica promoted after a failover)
            link.slots = next(
                slots for slots in (await self._read_map()).values() if link.slot in slots
            )
            master = self.cluster.nodes_manager.slots_cache[link.slot][0]
            link.client = node_client(self.cluster, master.host, master.port)
        elif link.client is None:
            link.client = self._client_factory()
        link.pubsub = link.client.pubsub()
        await link.pubsub.connect()
        if self._on_connect is not None:
            try:
                await self._on_connect()
            except Exception as exc:
                log.warning("event router: on-connect hook failed: %s", exc)
        await self._owner.on_link_connected(link, reconnect=link.was_connected)
        link.connected.set()
        link.was_connected = True

    async def _read(self, link: Link) -> None:
        loop = asyncio.get_running_loop()
        heard_at, pinged = loop.time(), False
        while True:
            message = await link.pubsub.get_message(timeout=POLL_S)
            idle_s = loop.time() - heard_at
            if message is not None:
                heard_at, pinged = loop.time(), False
                self._owner.on_message(link, message)
            elif idle_s > DEAD_AFTER_IDLE_S:
                raise ConnectionError(f"no answer from Redis in {idle_s:.0f}s")
            elif idle_s > PING_AFTER_IDLE_S and not pinged:
                await link.pubsub.ping()
                pinged = True
