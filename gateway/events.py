"""The event router: ONE Redis pub/sub connection per gateway process, shared by every job in
flight, routing each `cortex:events:{job}` message to that job's `asyncio.Queue`.

A job subscribes before it is enqueued, and `subscribe` returns only once Redis has confirmed
the subscription: pub/sub drops what nobody hears, so an earlier XADD could lose the first
tokens. When the connection breaks (Redis restarts, the network goes) every job in flight gets
`BrokerUnavailable` on its queue at once, and the router reconnects with backoff; nothing waits
for events that were published while nobody listened.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from shared.errors import BrokerUnavailable, CortexError, GenerationFailed
from shared.wire import Event, WireError, unpack_event

log = logging.getLogger(__name__)

Item = Event | CortexError  # what a job's queue holds

CONNECT_WAIT_S = 1.0  # how long a new job waits for a (re)connecting router before a 503
SUBSCRIBE_TIMEOUT_S = 5.0  # Redis confirms a SUBSCRIBE in well under a millisecond
POLL_S = 1.0  # the reader wakes at least this often to check the connection
PING_AFTER_IDLE_S = 5.0  # nothing heard for this long: send a PING
DEAD_AFTER_IDLE_S = 15.0  # not even the PING answered: the connection is dead
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.05, 2.0


def pubsub_client(url: str) -> aioredis.Redis:
    """A client without redis-py's own retry: a silent reconnect and resubscribe would hide the
    gap during which events were lost, so the router must see every broken connection."""
    return aioredis.Redis.from_url(url, socket_connect_timeout=2.0, socket_keepalive=True)


class EventRouter:
    def __init__(
        self,
        client_factory: Callable[[], aioredis.Redis],
        *,
        on_connect: Callable[[], Awaitable[None]] | None = None,
    ):
        self._client_factory = client_factory
        self._on_connect = on_connect  # run after every (re)connect, e.g. to rewrite the catalogue
        self._client: aioredis.Redis | None = None
        self._pubsub: PubSub | None = None
        self._queues: dict[bytes, asyncio.Queue[Item]] = {}
        self._confirmations: dict[bytes, asyncio.Future[None]] = {}
        self._connected = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cortex-event-router")

    async def stop(self) -> None:
        while self._task is not None and not self._task.done():
            self._task.cancel()  # again if need be: Python 3.11's wait_for can swallow a cancel
            await asyncio.wait({self._task}, timeout=0.1)
        await self._drop_connection("the gateway is shutting down")

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
        confirmed = asyncio.get_running_loop().create_future()
        self._queues[key], self._confirmations[key] = queue, confirmed
        try:
            await pubsub.subscribe(key)
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await confirmed
        except BaseException as exc:
            await self.unsubscribe(channel)
            if isinstance(exc, RedisError | OSError | TimeoutError):
                raise BrokerUnavailable(f"could not subscribe to {channel}: {exc or 'timed out'}") from exc
            raise
        return queue

    async def unsubscribe(self, channel: str) -> None:
        key = channel.encode()
        self._confirmations.pop(key, None)
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
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _connect(self) -> None:
        self._client = self._client_factory()
        self._pubsub = self._client.pubsub()
        await self._pubsub.connect()
        if self._on_connect is not None:
            try:
                await self._on_connect()
            except Exception as exc:
                log.warning("event router: on-connect hook failed: %s", exc)
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
        if kind == "message" and (queue := self._queues.get(channel)) is not None:
            try:
                queue.put_nowait(unpack_event(message["data"]))
            except WireError as exc:
                log.error("refusing an event on %s: %s", channel.decode(), exc)
                queue.put_nowait(GenerationFailed(f"the node sent an event this gateway cannot read: {exc}"))
        elif kind == "subscribe" and (confirmed := self._confirmations.pop(channel, None)) is not None:
            if not confirmed.done():
                confirmed.set_result(None)

    async def _drop_connection(self, why: str) -> None:
        """Fail every job in flight with a 503 and close the connection."""
        self._connected.clear()
        for queue in self._queues.values():
            queue.put_nowait(BrokerUnavailable(why))
        for confirmed in self._confirmations.values():
            if not confirmed.done():
                confirmed.set_exception(BrokerUnavailable(why))
        self._queues.clear()
        self._confirmations.clear()
        pubsub, client, self._pubsub, self._client = self._pubsub, self._client, None, None
        for closing in (pubsub, client):
            if closing is not None:
                try:
                    await closing.aclose()
                except (RedisError, OSError):
                    pass
