"""Redis connections with retry and backoff, the same for every part; the errors clients get when Redis
fails; and `Outage`, which keeps a retrying loop's log to two lines per outage."""

import logging
import time
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, OutOfMemoryError, ReadOnlyError, RedisError, TimeoutError

from shared.errors import BrokerCannotPersist, BrokerOutOfMemory, BrokerReadOnly, BrokerUnavailable

MESSAGE_CHARS = 300  # of a Redis error quoted in a message (a pipeline's error quotes its commands' values)
BACKOFF_MAX_S = 2.0  # the longest wait between two tries to reach Redis, for every part


def connect(url: str, **kwargs) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=BACKOFF_MAX_S, base=0.05), retries=5),
        retry_on_error=[ConnectionError, TimeoutError],
        health_check_interval=30,
        **kwargs,
    )


def redact(url: str) -> str:
    """The URL with its password hidden, for log lines and messages."""
    parts = urlsplit(url)
    return url.replace(f":{parts.password}@", ":***@") if parts.password else url


def broker_error(exc: RedisError, doing: str = "") -> BrokerUnavailable:
    """The 503 a client gets for a Redis failure, naming the cause: Redis out of memory, a read-only
    replica, a disk Redis cannot write to, or Redis unreachable. `doing`: what failed, for the message."""
    what = f"{doing}: " if doing else ""
    if isinstance(exc, OutOfMemoryError):
        return BrokerOutOfMemory(f"{what}Redis refuses writes: it is out of memory (used memory > maxmemory); "
                                 "an operator must free some (delete files, finished batches) or raise maxmemory")
    if isinstance(exc, ReadOnlyError):
        return BrokerReadOnly(f"{what}Redis refuses writes: it is a read-only replica; point CORTEX_REDIS_URL at "
                              "the primary")
    if str(exc).startswith("MISCONF"):
        return BrokerCannotPersist(f"{what}Redis refuses writes: it cannot save to disk (MISCONF); an operator must "
                                   "check its disk and log")
    return BrokerUnavailable(f"{what}Redis is unavailable: {str(exc)[:MESSAGE_CHARS] or type(exc).__name__}")


class Outage:
    """One loop's view of Redis going away: its first failure is logged (a warning), the retries are
    not, and Redis answering again is (once)."""

    def __init__(self, log: logging.Logger, what: str):
        self.log, self.what = log, what
        self.since: float | None = None  # monotonic time of the first failure of this outage

    def failed(self, exc: BaseException) -> None:
        if self.since is None:
            self.since = time.monotonic()
            self.log.warning("%s failed: %s; retrying quietly until it works", self.what,
                             str(exc) or type(exc).__name__)

    def ok(self) -> bool:
        """Call after a success; True when it ends an outage."""
        if self.since is None:
            return False
        self.log.info("%s works again after %.1fs", self.what, time.monotonic() - self.since)
        self.since = None
        return True
