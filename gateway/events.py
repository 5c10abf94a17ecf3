"""The event router: ONE Redis pub/sub connection per gateway process (on a Redis Cluster, one per
shard), shared by every job in flight, routing each `cortex:events:{job}` message to the
`asyncio.Queue` of each listener of that job here (the request that submitted it, and clients
resuming it: gateway/resume.py).

A job subscribes before it is enqueued, and `subscribe` returns only once Redis has confirmed
the subscription: pub/sub drops what nobody hears, so an earlier XADD could lose the first
tokens. When a connection breaks (Redis restarts, the network goes, a cluster's master dies) the
router reconnects it with backoff, and nothing waits for events that were published while nobody
listened; only the jobs whose channels that connection carried are touched:

- a job that has heard an event (a node runs it) gets `BrokerUnavailable` on its queue at once;
- a job still waiting in its stream (`track`ed, nothing heard) waits on, up to `outage_wait_s`.
  Once Redis is back the router subscribes to it again and then looks at its stream entry: still
  there and unread (or read only after the new subscription), it is served as if nothing had
  happened (a durable Redis, or the replica that took over, kept it); gone (a Redis that kept
  nothing), or read while nobody listened, it fails with `BrokerUnavailable`.

On a cluster (`redis+cluster://`), nodes SPUBLISH each job's events to the shard that holds its
channel's slot, and the router keeps one connection per shard, to whichever master holds the
shard's slots now (a replica promoted after a failover), SSUBSCRIBEd to the channels of those
slots. A shard whose slots move to another master (resharding) unsubscribes them: its jobs are
treated as after a broken connection.
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError, RedisError, ResponseError

from shared import queues
from shared.errors import BrokerUnavailable, CortexError, GenerationFailed, RedisUnreachable
from shared.keys import CONSUMER_GROUP
from shared.redis_conn import BACKOFF_MAX_S, cluster_client, is_cluster_url, node_client
from shared.wire import Event, WireError, unpack_event

log = logging.getLogger(__name__)

Item = Event | CortexError  # what a job's queue holds

CONNECT_WAIT_S = 1.0  # how long a new job waits for a (re)connecting router before a 503
SUBSCRIBE_TIMEOUT_S = 5.0  # Redis confirms a SUBSCRIBE in well under a millisecond
POLL_S = 1.0  # the reader wakes at least this often to check the connection
PING_AFTER_IDLE_S = 5.0  # nothing heard for this long: send a PING
DEAD_AFTER_IDLE_S = 15.0  # not even the PING answered: the connection is dead
BACKOFF_MIN_S = 0.05
WOKEN_AFTER_S = 0.1  # a reconnect a waiting request asks for comes no sooner than this after the last try
MESSAGES = ("message", "smessage")
CONFIRMATIONS = ("subscribe", "ssubscribe")


def pubsub_client(url: str) -> aioredis.Redis:
    """A client without redis-py's own retry: a silent reconnect and resubscribe would hide the
    gap during which events were lost, so the router must see every broken connection. On a
    cluster, the cluster's client: its map of the shards (the router connects to each master)."""
    if is_cluster_url(url):
        return cluster_client(url, socket_connect_timeout=2.0, socket_keepalive=True)
    return aioredis.Redis.from_url(url, socket_connect_timeout=2.0, socket_keepalive=True)


async def _reconnected(ready: asyncio.Event, wake: asyncio.Event | None = None) -> None:
    """Wait up to `CONNECT_WAIT_S` for a (re)connecting router; BrokerUnavailable after that.
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


class _Link:
    """One pub/sub connection: to the Redis, or to the master that holds one shard's slots."""

    def __init__(self, slot: int | None = None, slots: frozenset[int] = frozenset()):
        self.slot = slot  # a cluster: one slot of its shard (whoever holds it is asked at each connect)
        self.slots = slots  # ... and all of them, as of the last connect
        self.name = "Redis" if slot is None else f"the shard of slot {slot}"
        self.client: aioredis.Redis | None = None
        self.pubsub: PubSub | None = None
        self.connected = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.parked: set[bytes] = set()  # queued jobs waiting for this connection to come back
        self.parked_at = 0.0
        self.was_connected = False
        self.wake = asyncio.Event()  # set by a request waiting for this link: retry now (`_back_off`)

    @property
    def sharded(self) -> bool:
        return self.slot is not None


class EventRouter:
    def __init__(
        self,
        client_factory: Callable[[], aioredis.Redis],
        *,
        on_connect: Callable[[], Awaitable[None]] | None = None,
        outage_wait_s: float = 30.0,
    ):
        self._client_factory = client_factory
        self._on_connect = on_connect  # run after every (re)connect, e.g. to rewrite the catalogue
        self._outage_wait_s = outage_wait_s  # how long queued jobs wait for Redis to come back
        self._cluster: RedisCluster | None = None  # a cluster's client: its map, and commands
        self._links: list[_Link] = []
        self._mapped = asyncio.Event()  # the links exist (at once for one Redis; a cluster's map read)
        self._mapper: asyncio.Task | None = None
        self._link_of: dict[bytes, _Link] = {}  # channel -> the link it was subscribed on
        self._queues: dict[bytes, list[asyncio.Queue[Item]]] = {}  # channel -> its listeners' queues
        self._confirmations: dict[bytes, asyncio.Future[None]] = {}
        self._entries: dict[bytes, tuple[str, str]] = {}  # channel -> its job's (stream, entry id)
        self._heard: set[bytes] = set()  # channels an event came on
        self._checks: set[asyncio.Task] = set()

    @property
    def connected(self) -> bool:
        return self._mapped.is_set() and all(link.connected.is_set() for link in self._links)

    @property
    def in_flight(self) -> int:
        """Jobs with a listener here."""
        return len(self._queues)

    async def start(self) -> None:
        self._mapper = asyncio.create_task(self._map(), name="cortex-event-router")

    async def stop(self) -> None:
        tasks = [t for t in [self._mapper, *(link.task for link in self._links)] if t is not None]
        while any(not t.done() for t in tasks):
            for task in tasks:
                task.cancel()  # again if need be: Python 3.11's wait_for can swallow a cancel
            await asyncio.wait(tasks, timeout=0.1)
        for check in self._checks:
            check.cancel()
        for link in self._links:
            await self._drop_connection(link, "the gateway is shutting down", park=False)
        if self._cluster is not None:
            await self._cluster.aclose()

    async def subscribe(self, channel: str) -> asyncio.Queue[Item]:
        """Route `channel` to a new queue; returns once Redis has confirmed the subscription."""
        key = channel.encode()
        link = self._link_of.get(key) or await self._link_for(key)
        await _reconnected(link.connected, link.wake)
        pubsub = link.pubsub
        if pubsub is None:
            raise RedisUnreachable("Redis is unreachable; the gateway is reconnecting")
        queue: asyncio.Queue[Item] = asyncio.Queue()
        listeners = self._queues.setdefault(key, [])
        listeners.append(queue)
        if len(listeners) == 1:  # the first listener here: subscribe
            self._link_of[key] = link
            self._confirmations[key] = asyncio.get_running_loop().create_future()
        confirmed = self._confirmations.get(key)
        try:
            if len(listeners) == 1:
                await self._send(link, "SUBSCRIBE", key)
            if confirmed is not None:  # else subscribed (and confirmed) for an earlier listener
                async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                    await asyncio.shield(confirmed)
        except BaseException as exc:
            await self.unsubscribe(channel, queue)
            if isinstance(exc, RedisError | OSError | TimeoutError):
                raise RedisUnreachable(f"could not subscribe to {channel}: {exc or 'timed out'}") from exc
            raise
        return queue

    def track(self, channel: str, stream: str, entry_id: str) -> None:
        """The job listening on `channel` is queued as `entry_id` on `stream`: it may wait for Redis
        to come back rather than fail when the connection breaks before any event came."""
        if (key := channel.encode()) in self._queues:
            self._entries[key] = (stream, entry_id)

    async def unsubscribe(self, channel: str, queue: asyncio.Queue[Item]) -> None:
        """Stop routing `channel` to `queue`; the last listener here unsubscribes. Idempotent."""
        key = channel.encode()
        listeners = self._queues.get(key, [])
        if queue in listeners:
            listeners.remove(queue)
        if listeners:
            return
        link = self._link_of.get(key)
        self._confirmations.pop(key, None)
        self._forget(key)
        if link is None or not link.connected.is_set():
            return
        try:
            await self._send(link, "UNSUBSCRIBE", key)
        except (RedisError, OSError) as exc:  # the reader sees the broken connection too
            log.debug("unsubscribe %s failed: %s", channel, exc)

    @staticmethod
    async def _send(link: _Link, command: str, *keys: bytes) -> None:
        """(UN)SUBSCRIBE, or on a cluster SSUBSCRIBE / SUNSUBSCRIBE one channel at a time (the
        channels of one command must share a slot)."""
        if not link.sharded:
            await link.pubsub.execute_command(command, *keys)
            return
        for key in keys:
            await link.pubsub.execute_command("S" + command, key)

    # ---- the links ---------------------------------------------------------------------------

    async def _link_for(self, key: bytes) -> _Link:
        await _reconnected(self._mapped)
        if self._cluster is None:
            return self._links[0]
        slot = key_slot(key)
        link = next((link for link in self._links if slot in link.slots), None)
        if link is None:  # a shard this gateway has not met (the cluster grew): read the map again
            self._add_links(await self._read_map())
            link = next(link for link in self._links if slot in link.slots)
        return link

    async def _map(self) -> None:
        """Make the links: one for one Redis, or one per shard of the cluster, once its map is read."""
        first = self._client_factory()
        if not isinstance(first, RedisCluster):
            self._add_links({None: frozenset()}, first)
            return
        self._cluster, delay = first, BACKOFF_MIN_S
        while True:
            try:
                self._add_links(await self._read_map())
                return
            except (RedisError, OSError) as exc:
                log.warning("event router: the Redis Cluster is unreachable (%s); trying again in %.2fs", exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _read_map(self) -> dict[int, frozenset[int]]:
        """The cluster's shards now: a slot of each -> all its slots."""
        await self._cluster.nodes_manager.initialize()
        by_master: dict[str, set[int]] = {}
        for slot, nodes in self._cluster.nodes_manager.slots_cache.items():
            by_master.setdefault(nodes[0].name, set()).add(slot)
        return {min(slots): frozenset(slots) for slots in by_master.values()}

    def _add_links(self, shards: dict[int | None, frozenset[int]], client: aioredis.Redis | None = None) -> None:
        """Links to the shards not linked yet (`client`: the one Redis's first client)."""
        for slot, slots in shards.items():
            if slot is not None and any(slot in link.slots for link in self._links):
                continue
            link = _Link(slot, slots)
            link.client = client
            link.task = asyncio.create_task(self._run(link), name=f"cortex-event-router-{slot}")
            self._links.append(link)
        self._mapped.set()

    # ---- one link's reader task --------------------------------------------------------------

    async def _run(self, link: _Link) -> None:
        delay = BACKOFF_MIN_S
        while True:
            try:
                await self._connect(link)
                delay = BACKOFF_MIN_S
                log.info("event router connected to %s", link.name)
                await self._read(link)
            except (RedisError, OSError) as exc:
                log.warning("event router: %s unreachable (%s); reconnecting in %.2fs", link.name, exc, delay)
            except Exception:  # never let the router die: every job depends on it
                log.exception("event router: unexpected error; reconnecting in %.2fs", delay)
            await self._drop_connection(link, "lost the connection to Redis while the job was running")
            self._expire_parked(link)
            await _back_off(delay, link.wake)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _connect(self, link: _Link) -> None:
        if link.sharded:  # whoever holds the shard's slots now (a replica promoted after a failover)
            link.slots = next(slots for slots in (await self._read_map()).values() if link.slot in slots)
            master = self._cluster.nodes_manager.slots_cache[link.slot][0]
            link.client = node_client(self._cluster, master.host, master.port)
        elif link.client is None:
            link.client = self._client_factory()
        link.pubsub = link.client.pubsub()
        await link.pubsub.connect()
        if self._on_connect is not None:
            try:
                await self._on_connect()
            except Exception as exc:
                log.warning("event router: on-connect hook failed: %s", exc)
        if link.parked:
            parked, link.parked = list(link.parked), set()
            moved = [key for key in parked if link.sharded and key_slot(key) not in link.slots]
            for key in moved:  # resharded away: where its events went meanwhile is unknown
                self._tell(key, BrokerUnavailable("the Redis Cluster moved the job's events to another shard"))
                self._forget(key)
            parked = [key for key in parked if key not in moved]
            confirmations = {key: asyncio.get_running_loop().create_future() for key in parked}
            self._confirmations.update(confirmations)
            if parked:
                await self._send(link, "SUBSCRIBE", *parked)
            self._spawn(self._check_parked(link, confirmations))
        if link.sharded and link.was_connected:
            self._spawn(self.check_streams(link))
        link.connected.set()
        link.was_connected = True

    def _spawn(self, check: Awaitable[None]) -> None:
        task = asyncio.create_task(check, name="check-queued-jobs")
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def check_streams(self, link: _Link) -> None:
        """After `link`'s shard came back (a replica promoted): the queued jobs listened to on other
        shards whose entries that shard held. One whose entry is gone (a write the replica never
        got) fails with a 503; the others wait on (nobody stopped listening to them)."""
        queued = [(key, *self._entries[key]) for key in list(self._entries)
                  if key not in self._heard and self._link_of.get(key) is not link
                  and key_slot(self._entries[key][0].encode()) in link.slots]
        lost = 0
        for key, stream, entry_id in queued:
            try:
                if any([await self._cluster.xrange(home, min=entry_id, max=entry_id) for home in queues.homes(stream)]):
                    continue
            except (RedisError, OSError) as exc:
                log.warning("event router: could not check a queued job's entry on %s: %s", link.name, exc)
                return
            await asyncio.sleep(0.1)  # an event on its way from its own shard would say it ran and ended
            if key in self._queues and key not in self._heard:
                lost += 1
                self._tell(key, BrokerUnavailable("the job's queue entry was lost when its Redis master failed"))
                self._entries.pop(key, None)
        if queued:
            log.info("event router: %s is back; %d of the %d queued jobs it held were lost", link.name, lost, len(queued))

    async def _read(self, link: _Link) -> None:
        loop = asyncio.get_running_loop()
        heard_at, pinged = loop.time(), False
        while True:
            message = await link.pubsub.get_message(timeout=POLL_S)
            idle_s = loop.time() - heard_at
            if message is not None:
                heard_at, pinged = loop.time(), False
                self._dispatch(link, message)
            elif idle_s > DEAD_AFTER_IDLE_S:
                raise ConnectionError(f"no answer from Redis in {idle_s:.0f}s")
            elif idle_s > PING_AFTER_IDLE_S and not pinged:
                await link.pubsub.ping()
                pinged = True

    def _dispatch(self, link: _Link, message: dict) -> None:
        kind, channel = message["type"], message["channel"]
        if kind in MESSAGES and (listeners := self._queues.get(channel)):
            self._heard.add(channel)
            try:
                item = unpack_event(message["data"])
            except WireError as exc:
                log.error("refusing an event on %s: %s", channel.decode(), exc)
                item = GenerationFailed(f"the node sent an event this gateway cannot read: {exc}")
            for queue in listeners:
                queue.put_nowait(item)
        elif kind in CONFIRMATIONS and (confirmed := self._confirmations.pop(channel, None)) is not None:
            if not confirmed.done():
                confirmed.set_result(None)
        elif kind == "sunsubscribe" and self._link_of.get(channel) is link:  # not asked for: its slot moved
            raise ConnectionError(f"the Redis Cluster moved {channel.decode()} to another shard")

    async def _drop_connection(self, link: _Link, why: str, *, park: bool = True) -> None:
        """Close the link; its jobs that heard an event (or all, without `park`) fail with a 503,
        queued ones wait for it to come back."""
        link.connected.clear()
        for key in [key for key, on in self._link_of.items() if on is link]:
            if park and key in self._entries and key not in self._heard:
                link.parked.add(key)
                continue
            self._tell(key, BrokerUnavailable(why))
            if (confirmed := self._confirmations.pop(key, None)) is not None and not confirmed.done():
                confirmed.set_exception(BrokerUnavailable(why))
            self._forget(key)
        for key in link.parked:
            if (confirmed := self._confirmations.pop(key, None)) is not None and not confirmed.done():
                confirmed.set_exception(BrokerUnavailable(why))
        if link.parked and not link.parked_at:
            link.parked_at = asyncio.get_running_loop().time()
            log.warning("event router: %d queued jobs wait up to %gs for %s to come back", len(link.parked),
                        self._outage_wait_s, link.name)
        pubsub, client, link.pubsub, link.client = link.pubsub, link.client, None, None
        for closing in (pubsub, client):
            if closing is not None:
                try:
                    await closing.aclose()
                except (RedisError, OSError):
                    pass

    def _tell(self, key: bytes, error: CortexError) -> None:
        for queue in self._queues.get(key, []):
            queue.put_nowait(error)

    def _forget(self, key: bytes) -> None:
        self._queues.pop(key, None)
        self._entries.pop(key, None)
        self._heard.discard(key)
        if (link := self._link_of.pop(key, None)) is not None:
            link.parked.discard(key)

    def _expire_parked(self, link: _Link) -> None:
        """Queued jobs that waited `outage_wait_s` for Redis fail."""
        if link.parked and asyncio.get_running_loop().time() - link.parked_at > self._outage_wait_s:
            for key in list(link.parked):
                self._tell(key, BrokerUnavailable(
                    f"Redis did not come back within {self._outage_wait_s:g}s while the job was queued"))
                self._forget(key)
        if not link.parked:
            link.parked_at = 0.0

    async def _check_parked(self, link: _Link, confirmations: dict[bytes, asyncio.Future[None]]) -> None:
        """Once subscribed again: serve each queued job whose entry is still unread (or was read
        only after this subscription); fail the others, whose events may have been lost."""
        loop = asyncio.get_running_loop()
        link.parked_at = 0.0
        try:
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await asyncio.gather(*confirmations.values())
        except (BrokerUnavailable, TimeoutError):  # the connection broke again: the next reconnect checks
            return
        listening_ms = loop.time() * 1000
        resumed = 0
        for key in confirmations:
            if key not in self._queues or key in self._heard or key not in self._entries:
                continue  # the client left, or the job is being served
            stream, entry_id = self._entries[key]
            try:
                waiting = await self._still_queued(link, stream, entry_id, loop.time() * 1000 - listening_ms)
            except (RedisError, OSError) as exc:
                waiting, why = False, f"could not check the job's entry after Redis came back: {exc}"
            else:
                why = "the job's entry was lost or read while Redis restarted"
            if waiting:
                resumed += 1
            elif key in self._queues and key not in self._heard:
                self._tell(key, BrokerUnavailable(why))
                self._entries.pop(key, None)  # failed: never parked again
        log.info("event router: %s is back; %d of %d queued jobs wait on", link.name, resumed, len(confirmations))

    async def _still_queued(self, link: _Link, stream: str, entry_id: str, listening_for_ms: float) -> bool:
        client = self._cluster if link.sharded else link.client
        if client is None:
            raise ConnectionError("not connected")
        try:
            pending = await client.xpending_range(stream, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1)
        except ResponseError as exc:
            if str(exc).startswith("NOGROUP"):  # the stream itself is gone (a Redis that kept nothing)
                return False
            raise
        if pending:  # read by a node: fine only if that was after we listened again
            return pending[0]["time_since_delivered"] < listening_for_ms
        return bool(await client.xrange(stream, min=entry_id, max=entry_id))
