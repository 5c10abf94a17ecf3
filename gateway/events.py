"""The event router: ONE Redis pub/sub connection per gateway process, shared by every job in
flight, routing each `cortex:events:{job}` message to the `asyncio.Queue` of each listener of that
job here (the request that submitted it, and clients resuming it: gateway/resume.py).

A job subscribes before it is enqueued, and `subscribe` returns only once Redis has confirmed
the subscription: pub/sub drops what nobody hears, so an earlier XADD could lose the first
tokens. When the connection breaks (Redis restarts, the network goes) the router reconnects with
backoff, and nothing waits for events that were published while nobody listened:

- a job that has heard an event (a node runs it) gets `BrokerUnavailable` on its queue at once;
- a job still waiting in its stream (`track`ed, nothing heard) waits on, up to `outage_wait_s`.
  Once Redis is back the router subscribes to it again and then looks at its stream entry: still
  there and unread (or read only after the new subscription), it is served as if nothing had
  happened (a durable Redis kept it); gone (a Redis that kept nothing), or read while nobody
  listened, it fails with `BrokerUnavailable`.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError, ResponseError

from gateway.sharded_pubsub import ShardedPubSub

from shared.errors import BrokerUnavailable, CortexError, GenerationFailed
from shared.keys import CONSUMER_GROUP
from shared.redis_conn import BACKOFF_MAX_S, cluster_client, is_cluster, is_cluster_url
from shared.wire import Event, WireError, unpack_event

log = logging.getLogger(__name__)

Item = Event | CortexError  # what a job's queue holds

CONNECT_WAIT_S = 1.0  # how long a new job waits for a (re)connecting router before a 503
SUBSCRIBE_TIMEOUT_S = 5.0  # Redis confirms a SUBSCRIBE in well under a millisecond
POLL_S = 1.0  # the reader wakes at least this often to check the connection
PING_AFTER_IDLE_S = 5.0  # nothing heard for this long: send a PING
DEAD_AFTER_IDLE_S = 15.0  # not even the PING answered: the connection is dead
BACKOFF_MIN_S = 0.05


def pubsub_client(url: str) -> aioredis.Redis:
    """A client without redis-py's own retry: a silent reconnect and resubscribe would hide the
    gap during which events were lost, so the router must see every broken connection. On a
    cluster, the cluster's client (its map of the masters; `ShardedPubSub` connects to each)."""
    if is_cluster_url(url):
        return cluster_client(url, socket_connect_timeout=2.0, socket_keepalive=True)
    return aioredis.Redis.from_url(url, socket_connect_timeout=2.0, socket_keepalive=True)


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
        self._client: aioredis.Redis | None = None
        self._pubsub: PubSub | None = None
        self._queues: dict[bytes, list[asyncio.Queue[Item]]] = {}  # channel -> its listeners' queues
        self._confirmations: dict[bytes, asyncio.Future[None]] = {}
        self._entries: dict[bytes, tuple[str, str]] = {}  # channel -> its job's (stream, entry id)
        self._heard: set[bytes] = set()  # channels an event came on
        self._parked: set[bytes] = set()  # queued jobs waiting for Redis to come back
        self._parked_at = 0.0
        self._checks: set[asyncio.Task] = set()
        self._connected = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def in_flight(self) -> int:
        """Jobs with a listener here."""
        return len(self._queues)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cortex-event-router")

    async def stop(self) -> None:
        while self._task is not None and not self._task.done():
            self._task.cancel()  # again if need be: Python 3.11's wait_for can swallow a cancel
            await asyncio.wait({self._task}, timeout=0.1)
        for check in self._checks:
            check.cancel()
        await self._drop_connection("the gateway is shutting down", park=False)

    async def subscribe(self, channel: str) -> asyncio.Queue[Item]:
        """Route `channel` to a new queue; returns once Redis has confirmed the subscription."""
        if not self._connected.is_set():
            try:
                async with asyncio.timeout(CONNECT_WAIT_S):
                    await self._connected.wait()
            except TimeoutError:
                raise BrokerUnavailable("Redis is unreachable; the gateway is reconnecting") from None
        pubsub = self._pubsub
        if pubsub is None:
            raise BrokerUnavailable("Redis is unreachable; the gateway is reconnecting")
        key = channel.encode()
        queue: asyncio.Queue[Item] = asyncio.Queue()
        listeners = self._queues.setdefault(key, [])
        listeners.append(queue)
        if len(listeners) == 1:  # the first listener here: subscribe
            self._confirmations[key] = asyncio.get_running_loop().create_future()
        confirmed = self._confirmations.get(key)
        try:
            if len(listeners) == 1:
                await pubsub.subscribe(key)
            if confirmed is not None:  # else subscribed (and confirmed) for an earlier listener
                async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                    await asyncio.shield(confirmed)
        except BaseException as exc:
            await self.unsubscribe(channel, queue)
            if isinstance(exc, RedisError | OSError | TimeoutError):
                raise BrokerUnavailable(f"could not subscribe to {channel}: {exc or 'timed out'}") from exc
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
        self._confirmations.pop(key, None)
        self._entries.pop(key, None)
        self._heard.discard(key)
        self._parked.discard(key)
        if self._queues.pop(key, None) is None or not self._connected.is_set():
            return
        try:
            await self._pubsub.unsubscribe(key)
        except (RedisError, OSError) as exc:  # the reader sees the broken connection too
            log.debug("unsubscribe %s failed: %s", channel, exc)

    # ---- the reader task ------------------------------------------------------------------

    async def _run(self) -> None:
        delay = BACKOFF_MIN_S
        while True:
            try:
                await self._connect()
                delay = BACKOFF_MIN_S
                log.info("event router connected to Redis")
                await self._read()
            except (RedisError, OSError) as exc:
                log.warning("event router: Redis unreachable (%s); reconnecting in %.2fs", exc, delay)
            except Exception:  # never let the router die: every job depends on it
                log.exception("event router: unexpected error; reconnecting in %.2fs", delay)
            await self._drop_connection("lost the connection to Redis while the job was running")
            self._expire_parked()
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _connect(self) -> None:
        if not is_cluster(self._client):  # a cluster's client is kept: it knows every node, not just the URL's
            self._client = self._client_factory()
        self._pubsub = (ShardedPubSub(self._client) if is_cluster(self._client)
                        else self._client.pubsub())
        await self._pubsub.connect()
        if self._on_connect is not None:
            try:
                await self._on_connect()
            except Exception as exc:
                log.warning("event router: on-connect hook failed: %s", exc)
        if self._parked:
            parked, self._parked = list(self._parked), set()
            confirmations = {key: asyncio.get_running_loop().create_future() for key in parked}
            self._confirmations.update(confirmations)
            await self._pubsub.subscribe(*parked)
            check = asyncio.create_task(self._check_parked(confirmations), name="check-parked-jobs")
            self._checks.add(check)
            check.add_done_callback(self._checks.discard)
        self._connected.set()

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        heard_at, pinged = loop.time(), False
        while True:
            message = await self._pubsub.get_message(timeout=POLL_S)
            idle_s = loop.time() - heard_at
            if message is not None:
                heard_at, pinged = loop.time(), False
                self._dispatch(message)
            elif idle_s > DEAD_AFTER_IDLE_S:
                raise ConnectionError(f"no answer from Redis in {idle_s:.0f}s")
            elif idle_s > PING_AFTER_IDLE_S and not pinged:
                await self._pubsub.ping()
                pinged = True

    def _dispatch(self, message: dict) -> None:
        kind, channel = message["type"], message["channel"]
        if kind == "message" and (listeners := self._queues.get(channel)):
            self._heard.add(channel)
            try:
                item = unpack_event(message["data"])
            except WireError as exc:
                log.error("refusing an event on %s: %s", channel.decode(), exc)
                item = GenerationFailed(f"the node sent an event this gateway cannot read: {exc}")
            for queue in listeners:
                queue.put_nowait(item)
        elif kind == "subscribe" and (confirmed := self._confirmations.pop(channel, None)) is not None:
            if not confirmed.done():
                confirmed.set_result(None)

    async def _drop_connection(self, why: str, *, park: bool = True) -> None:
        """Close the connection; jobs that heard an event (or all, without `park`) fail with a 503,
        queued ones wait for Redis to come back."""
        self._connected.clear()
        for key in list(self._queues):
            if park and key in self._entries and key not in self._heard:
                self._parked.add(key)
                continue
            self._tell(key, BrokerUnavailable(why))
            self._forget(key)
        for confirmed in self._confirmations.values():
            if not confirmed.done():
                confirmed.set_exception(BrokerUnavailable(why))
        self._confirmations.clear()
        if self._parked and not self._parked_at:
            self._parked_at = asyncio.get_running_loop().time()
            log.warning("event router: %d queued jobs wait up to %gs for Redis to come back", len(self._parked),
                        self._outage_wait_s)
        pubsub, client, self._pubsub = self._pubsub, self._client, None
        self._client = client if is_cluster(client) and park else None  # closed, but it still knows the nodes
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
        self._parked.discard(key)

    def _expire_parked(self) -> None:
        """Queued jobs that waited `outage_wait_s` for Redis fail."""
        if self._parked and asyncio.get_running_loop().time() - self._parked_at > self._outage_wait_s:
            for key in list(self._parked):
                self._tell(key, BrokerUnavailable(
                    f"Redis did not come back within {self._outage_wait_s:g}s while the job was queued"))
                self._forget(key)
        if not self._parked:
            self._parked_at = 0.0

    async def _check_parked(self, confirmations: dict[bytes, asyncio.Future[None]]) -> None:
        """Once subscribed again: serve each queued job whose entry is still unread (or was read
        only after this subscription); fail the others, whose events may have been lost."""
        loop = asyncio.get_running_loop()
        self._parked_at = 0.0
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
                waiting = await self._still_queued(stream, entry_id, loop.time() * 1000 - listening_ms)
            except (RedisError, OSError) as exc:
                waiting, why = False, f"could not check the job's entry after Redis came back: {exc}"
            else:
                why = "the job's entry was lost or read while Redis restarted"
            if waiting:
                resumed += 1
            elif key in self._queues and key not in self._heard:
                self._tell(key, BrokerUnavailable(why))
                self._entries.pop(key, None)  # failed: never parked again
        log.info("event router: Redis is back; %d of %d queued jobs wait on", resumed, len(confirmations))

    async def _still_queued(self, stream: str, entry_id: str, listening_for_ms: float) -> bool:
        client = self._client
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
