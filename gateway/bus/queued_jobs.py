"""What happens to a job waiting in its stream when the connection its events come on breaks
(gateway/bus/router.py, gateway/bus/links.py). A job that has heard an event (a node runs it) fails
at once: its events went to nobody. A job still queued (`track`ed, nothing heard) is parked for up
to `outage_wait_s`. Once its link is back it is subscribed again, and then its stream entry decides:
still unread, or read only after the new subscription, it is served as if nothing had happened (a
durable Redis, or the replica that took over, kept it); gone (a Redis that kept nothing), or read
while nobody listened, it fails with `BrokerUnavailable`.

On a cluster a job's stream and its channel may live on different shards: when a stream's shard
comes back after a failover, the queued jobs listened to elsewhere whose entries it held are
checked by the same rule (`entry_waiting`, the one copy of it)."""

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ConnectionError, RedisError, ResponseError

from gateway.bus.links import Link
from gateway.bus.listeners import Listeners
from shared import queues
from shared.errors import BrokerUnavailable
from shared.keys import CONSUMER_GROUP

log = logging.getLogger(__name__)

SUBSCRIBE_TIMEOUT_S = 5.0  # Redis confirms a SUBSCRIBE in well under a millisecond
SETTLE_S = 0.1  # an event on its way from another shard would say the job ran and ended


async def entry_waiting(
    client: aioredis.Redis | None, stream: str, entry_id: str, listening_for_ms: float
) -> bool:
    """Whether the job queued as `entry_id` on `stream` (or moved from there: `queues.homes`) may
    still be served: unread, or read by a node only within the last `listening_for_ms` (after its
    events were listened to again)."""
    if client is None:
        raise ConnectionError("not connected")
    for home in queues.homes(stream):
        try:
            pending = await client.xpending_range(
                home, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1
            )
        except ResponseError as exc:
            if str(exc).startswith(
                "NOGROUP"
            ):  # the stream itself is gone (a Redis that kept nothing)
                continue
            raise
        if pending:  # read by a node: fine only if that was after we listened again
            return pending[0]["time_since_delivered"] < listening_for_ms
        if await client.xrange(home, min=entry_id, max=entry_id):
            return True
    return False


Resubscribe = Callable[
    [Link, list[bytes]], Awaitable[dict[bytes, asyncio.Future[None]]]
]  # the router's


class QueuedJobs:
    def __init__(self, listeners: Listeners, resubscribe: Resubscribe, outage_wait_s: float):
        self._listeners, self._resubscribe, self.outage_wait_s = (
            listeners,
            resubscribe,
            outage_wait_s,
        )
        self.entries: dict[bytes, tuple[str, str]] = {}  # channel -> its job's (stream, entry id)
        self._parked: dict[
            Link, set[bytes]
        ] = {}  # per link: queued jobs waiting for it to come back
        self._parked_at: dict[Link, float] = {}
        self._checks: set[asyncio.Task] = set()

    def track(self, key: bytes, stream: str, entry_id: str) -> None:
        self.entries[key] = (stream, entry_id)

    def forget(self, key: bytes) -> None:
        self.entries.pop(key, None)
        for parked in self._parked.values():
            parked.discard(key)

    def stop(self) -> None:
        for check in self._checks:
            check.cancel()

    def park(self, link: Link, keys: list[bytes]) -> list[bytes]:
        """`link` broke: park its queued jobs; returns the others (they fail)."""
        parked = self._parked.setdefault(link, set())
        failing = []
        for key in keys:
            if key in self.entries and self._listeners.waiting(key):
                parked.add(key)
            else:
                failing.append(key)
        if parked and link not in self._parked_at:
            self._parked_at[link] = asyncio.get_running_loop().time()
            log.warning(
                "event router: %d queued jobs wait up to %gs for %s to come back",
                len(parked),
                self.outage_wait_s,
                link.name,
            )
        return failing

    def parked(self, link: Link) -> set[bytes]:
        return self._parked.get(link, set())

    def expire(self, link: Link) -> None:
        """Queued jobs that waited `outage_wait_s` for `link` fail."""
        parked = self._parked.get(link, set())
        since = self._parked_at.get(link)
        if (
            parked
            and since is not None
            and asyncio.get_running_loop().time() - since > self.outage_wait_s
        ):
            for key in list(parked):
                self._listeners.tell(
                    key,
                    BrokerUnavailable(
                        f"Redis did not come back within {self.outage_wait_s:g}s while the job was queued"
                    ),
                )
                self._listeners.forget(key)
        if not parked:
            self._parked_at.pop(link, None)

    async def came_back(self, link: Link, reconnect: bool, commands: aioredis.Redis | None) -> None:
        """`link` is connected again: subscribe its parked jobs again, then check them (in the
        background); on a cluster, check the jobs whose entries its shard held."""
        parked, self._parked[link] = list(self._parked.get(link, ())), set()
        moved = [key for key in parked if link.sharded and key_slot(key) not in link.slots]
        for key in moved:  # resharded away: where its events went meanwhile is unknown
            self._listeners.tell(
                key, BrokerUnavailable("the Redis Cluster moved the job's events to another shard")
            )
            self._listeners.forget(key)
        parked = [key for key in parked if key not in moved]
        if parked:
            confirmations = await self._resubscribe(link, parked)
            self._spawn(self._check_parked(link, confirmations, commands))
        else:
            self._parked_at.pop(link, None)
        if link.sharded and reconnect:
            self._spawn(self.check_after_failover(link, commands))

    def _spawn(self, check) -> None:
        task = asyncio.create_task(check, name="check-queued-jobs")
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check_parked(
        self,
        link: Link,
        confirmations: dict[bytes, asyncio.Future[None]],
        commands: aioredis.Redis | None,
    ) -> None:
        """Once subscribed again: serve each queued job whose entry may still be served; fail the
        others, whose events may have been lost."""
        loop = asyncio.get_running_loop()
        self._parked_at.pop(link, None)
        try:
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await asyncio.gather(*confirmations.values())
        except (
            BrokerUnavailable,
            TimeoutError,
        ):  # the connection broke again: the next reconnect checks
            return
        listening_ms = loop.time() * 1000
        resumed = 0
        for key in confirmations:
            if not self._listeners.waiting(key) or key not in self.entries:
                continue  # the client left, or the job is being served
            stream, entry_id = self.entries[key]
            try:
                waiting = await entry_waiting(
                    commands, stream, entry_id, loop.time() * 1000 - listening_ms
                )
            except (RedisError, OSError) as exc:
                waiting, why = (
                    False,
                    f"could not check the job's entry after Redis came back: {exc}",
                )
            else:
                why = "the job's entry was lost or read while Redis restarted"
            if waiting:
                resumed += 1
            elif self._listeners.waiting(key):
                self._listeners.tell(key, BrokerUnavailable(why))
                self.entries.pop(key, None)  # failed: never parked again
        log.info(
            "event router: %s is back; %d of %d queued jobs wait on",
            link.name,
            resumed,
            len(confirmations),
        )

    async def check_after_failover(self, link: Link, commands: aioredis.Redis | None) -> None:
        """`link`'s shard came back (a replica promoted): the queued jobs listened to on other shards
        whose entries that shard held. One whose entry is gone (a write the replica never got)
        fails with a 503; the others wait on (nobody stopped listening to them)."""
        queued = [
            (key, *self.entries[key])
            for key in list(self.entries)
            if self._listeners.waiting(key)
            and self._listeners.link_of(key) is not link
            and key_slot(self.entries[key][0].encode()) in link.slots
        ]
        lost = 0
        for key, stream, entry_id in queued:
            try:
                if await entry_waiting(commands, stream, entry_id, listening_for_ms=float("inf")):
                    continue
            except (RedisError, OSError) as exc:
                log.warning(
                    "event router: could not check a queued job's entry on %s: %s", link.name, exc
                )
                return
            await asyncio.sleep(SETTLE_S)
            if self._listeners.waiting(key):
                lost += 1
                self._listeners.tell(
                    key,
                    BrokerUnavailable(
                        "the job's queue entry was lost when its Redis master failed"
                    ),
                )
                self.entries.pop(key, None)
        if queued:
            log.info(
                "event router: %s is back; %d of the %d queued jobs it held were lost",
                link.name,
                lost,
                len(queued),
            )
