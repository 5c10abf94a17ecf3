"""New requests during a short Redis outage (a restart, a failover): instead of a 503 at once, which
clients that retry at once turn into a storm of failures, a request whose admission finds Redis
unreachable waits for it to answer again and then tries again, as jobs already queued wait
(gateway/bus/router.py). Bounded twice: by `redis_outage_wait_s` from its first failure, and by
`redis_outage_max_waiting` requests waiting on one gateway at once (a request past it is refused at
once); either way the answer is then a 503. One probe per gateway PINGs Redis with backoff for
every waiting request."""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
import redis.exceptions

from shared.errors import RedisUnreachable
from shared.redis_conn import BACKOFF_MAX_S

log = logging.getLogger(__name__)

T = TypeVar("T")
FIRST_PROBE_S = 0.05  # the probe's first wait between PINGs; doubled up to BACKOFF_MAX_S
PING_TIMEOUT_S = 0.5  # one PING of the probe (the client's own retries would take seconds)


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says Redis did not answer (rather than answered no)."""
    return isinstance(
        exc,
        (
            RedisUnreachable,
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            OSError,
        ),
    )


class OutageWait:
    def __init__(self, redis: aioredis.Redis, wait_s: float, max_waiting: int):
        self.redis, self.wait_s, self.max_waiting = redis, wait_s, max_waiting
        self.waiting = 0  # requests waiting for Redis now
        self._back: asyncio.Task[None] | None = None  # the probe: done once Redis answers

    async def through(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()`, tried again each time Redis answers again after it failed for want of Redis,
        until `wait_s` has passed since the first failure; then, or when `max_waiting` requests wait
        already, the failure as a `RedisUnreachable` (503)."""
        try:
            return await attempt()
        except Exception as exc:
            if not unreachable(exc):
                raise
            if self.waiting >= self.max_waiting:
                raise RedisUnreachable(
                    f"Redis is unreachable and {self.waiting} requests already wait for it on "
                    "this gateway (redis_outage_max_waiting)"
                ) from exc
            first = exc
        deadline = asyncio.get_running_loop().time() + self.wait_s
        self.waiting += 1
        try:
            while True:
                await self._answers(deadline, first)
                try:
                    return await attempt()
                except Exception as exc:
                    if not unreachable(exc):
                        raise
                    first = exc
        finally:
            self.waiting -= 1

    def stop(self) -> None:
        """At shutdown: no more probing."""
        if self._back is not None:
            self._back.cancel()

    async def _answers(self, deadline: float, failure: BaseException) -> None:
        """Until Redis answers a PING, or `RedisUnreachable` at `deadline`."""
        if self._back is None or self._back.done():
            self._back = asyncio.create_task(self._probe(), name="redis-outage-probe")
        left = deadline - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(max(left, 0)):
                await asyncio.shield(self._back)
        except TimeoutError:
            raise RedisUnreachable(
                f"Redis did not come back within {self.wait_s:g}s (redis_outage_wait_s): "
                f"{str(failure) or type(failure).__name__}"
            ) from failure

    async def _probe(self) -> None:
        delay = FIRST_PROBE_S
        log.warning(
            "Redis is unreachable: new requests wait up to %gs for it (at most %d at once)",
            self.wait_s,
            self.max_waiting,
        )
        while True:
            with contextlib.suppress(redis.exceptions.RedisError, OSError, TimeoutError):
                async with asyncio.timeout(PING_TIMEOUT_S):
                    await self.redis.ping()
                log.info("Redis answers again: %d waiting requests go on", self.waiting)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
