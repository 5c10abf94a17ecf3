"""The event router: ONE Redis pub/sub connection per gateway process (on a Redis Cluster, one per
shard), shared by every job in flight, routing each `cortex:events:{job}` message to the
`asyncio.Queue` of each listener of that job here (the request that submitted it, and clients
resuming it: gateway/jobs/resume.py).

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

The connections and the shard map are gateway/bus/links.py; who listens here to which job,
gateway/bus/listeners.py; what a broken connection means for a queued job, gateway/bus/queued_jobs.py.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError, RedisError

from gateway.bus.links import Link, Links, reconnected
from gateway.bus.listeners import Item, Listeners
from gateway.bus.queued_jobs import SUBSCRIBE_TIMEOUT_S, QueuedJobs
from shared.errors import BrokerUnavailable, GenerationFailed, RedisUnreachable
from shared.wire import WireError, unpack_event

log = logging.getLogger(__name__)

MESSAGES = ("message", "smessage")
CONFIRMATIONS = ("subscribe", "ssubscribe")


class EventRouter:
    def __init__(
        self,
        client_factory: Callable[[], aioredis.Redis],
        *,
        on_connect: Callable[[], Awaitable[None]] | None = None,
        outage_wait_s: float = 30.0,
    ):
        self.links = Links(client_factory, self, on_connect)
        self.listeners = Listeners(
            on_forget=lambda key: self.queued.forget(key)
        )  # who listens to which job
        self.queued = QueuedJobs(
            self.listeners, self.resubscribe, outage_wait_s
        )  # a broken link's queued jobs
        self._confirmations: dict[
            bytes, asyncio.Future[None]
        ] = {}  # channel -> its SUBSCRIBE, until confirmed

    @property
    def connected(self) -> bool:
        return self.links.connected

    @property
    def in_flight(self) -> int:
        """Jobs with a listener here."""
        return len(self.listeners)

    async def start(self) -> None:
        await self.links.start()

    async def stop(self) -> None:
        await self.links.stop()
        self.queued.stop()
        for link in self.links.all:
            link.connected.clear()
            self._fail_all(self.listeners.on(link), "the gateway is shutting down")
            await self.links.close_link(link)
        await self.links.close()

    async def subscribe(self, channel: str) -> asyncio.Queue[Item]:
        """Route `channel` to a new queue; returns once Redis has confirmed the subscription."""
        key = channel.encode()
        link = self.listeners.link_of(key) or await self.links.link_for(key)
        await reconnected(link.connected, link.wake)
        pubsub = link.pubsub
        if pubsub is None:
            raise RedisUnreachable("Redis is unreachable; the gateway is reconnecting")
        queue: asyncio.Queue[Item] = asyncio.Queue()
        first = self.listeners.add(key, queue, link)
        if first:  # the first listener here: subscribe
            self._confirmations[key] = asyncio.get_running_loop().create_future()
        confirmed = self._confirmations.get(key)
        try:
            if first:
                await self.links.send(link, "SUBSCRIBE", key)
            if confirmed is not None:  # else subscribed (and confirmed) for an earlier listener
                async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                    await asyncio.shield(confirmed)
        except BaseException as exc:
            await self.unsubscribe(channel, queue)
            if isinstance(exc, RedisError | OSError | TimeoutError):
                raise RedisUnreachable(
                    f"could not subscribe to {channel}: {exc or 'timed out'}"
                ) from exc
            raise
        return queue

    def track(self, channel: str, stream: str, entry_id: str) -> None:
        """The job listening on `channel` is queued as `entry_id` on `stream`: it may wait for Redis
        to come back rather than fail when the connection breaks before any event came."""
        if (key := channel.encode()) in self.listeners:
            self.queued.track(key, stream, entry_id)

    async def unsubscribe(self, channel: str, queue: asyncio.Queue[Item]) -> None:
        """Stop routing `channel` to `queue`; the last listener here unsubscribes. Idempotent."""
        key = channel.encode()
        link = self.listeners.link_of(key)
        if not self.listeners.remove(key, queue):  # others still listen
            return
        self._confirmations.pop(key, None)
        if link is None or not link.connected.is_set():
            return
        try:
            await self.links.send(link, "UNSUBSCRIBE", key)
        except (RedisError, OSError) as exc:  # the reader sees the broken connection too
            log.debug("unsubscribe %s failed: %s", channel, exc)

    # ---- what the links report (gateway/bus/links.py) -----------------------------------------

    def on_message(self, link: Link, message: dict) -> None:
        kind, channel = message["type"], message["channel"]
        if kind in MESSAGES and channel in self.listeners:
            try:
                item = unpack_event(message["data"])
            except WireError as exc:
                log.error("refusing an event on %s: %s", channel.decode(), exc)
                item = GenerationFailed(f"the node sent an event this gateway cannot read: {exc}")
            self.listeners.hear(channel, item)
        elif (
            kind in CONFIRMATIONS
            and (confirmed := self._confirmations.pop(channel, None)) is not None
        ):
            if not confirmed.done():
                confirmed.set_result(None)
        elif (
            kind == "sunsubscribe" and self.listeners.link_of(channel) is link
        ):  # not asked for: its slot moved
            raise ConnectionError(f"the Redis Cluster moved {channel.decode()} to another shard")

    async def on_link_connected(self, link: Link, reconnect: bool) -> None:
        await self.queued.came_back(link, reconnect, self.links.commands(link))

    async def on_link_dropped(self, link: Link, why: str) -> None:
        """`link` broke: its jobs that heard an event fail with a 503, queued ones wait for it to
        come back (for `outage_wait_s`, then they fail too)."""
        self._fail_all(self.queued.park(link, self.listeners.on(link)), why)
        for key in self.queued.parked(
            link
        ):  # a resubscription of theirs in flight will not be confirmed
            self._fail_confirmation(key, why)
        self.queued.expire(link)

    def _fail_all(self, keys: list[bytes], why: str) -> None:
        for key in keys:
            self.listeners.tell(key, BrokerUnavailable(why))
            self._fail_confirmation(key, why)
            self.listeners.forget(key)

    def _fail_confirmation(self, key: bytes, why: str) -> None:
        if (confirmed := self._confirmations.pop(key, None)) is not None and not confirmed.done():
            confirmed.set_exception(BrokerUnavailable(why))

    # ---- what the parking rules ask (gateway/bus/queued_jobs.py) -----------------------------------

    async def resubscribe(self, link: Link, keys: list[bytes]) -> dict[bytes, asyncio.Future[None]]:
        """Subscribe the parked jobs' channels again on `link`; each one's confirmation, to await."""
        confirmations = {key: asyncio.get_running_loop().create_future() for key in keys}
        self._confirmations.update(confirmations)
        await self.links.send(link, "SUBSCRIBE", *keys)
        return confirmations
