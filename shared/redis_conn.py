"""Redis connections with retry and backoff, the same for every part, to one Redis or to a Redis
Cluster; the few commands that differ between the two; the errors clients get when Redis fails;
and `Outage`, which keeps a retrying loop's log to two lines per outage.

`CORTEX_REDIS_URL` names a cluster with the scheme ``redis+cluster://host:port[,host:port…]`` (or
``rediss+cluster://``): some of its nodes, where a client first asks for the cluster's map. On a cluster, Cortex's keys
carry hash tags (`shared.keys`), job events use sharded pub/sub (SPUBLISH), and the groups of
writes Cortex sends as MULTI/EXEC on one Redis go as pipelines (`atomic`): each command atomic,
the group not, since redis-py's asyncio cluster client has no transactions.
"""

import logging
import time
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    ConnectionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    TimeoutError,
)

from shared.errors import (
    BrokerCannotPersist,
    BrokerOutOfMemory,
    BrokerReadOnly,
    BrokerUnavailable,
    RedisUnreachable,
)

MESSAGE_CHARS = (
    300  # of a Redis error quoted in a message (a pipeline's error quotes its commands' values)
)
BACKOFF_MAX_S = 2.0  # the longest wait between two tries to reach Redis, for every part


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def node_url(url: str) -> str:
    """A cluster URL as the plain URL of the node it names (redis-py's own scheme); others unchanged."""
    scheme = urlsplit(url).scheme
    return CLUSTER_SCHEMES[scheme] + url[len(scheme) :] if scheme in CLUSTER_SCHEMES else url


def seed_urls(url: str) -> list[str]:
    """The plain URL of each node a cluster URL names (``redis+cluster://[user:password@]h1:p1,h2:p2``
    → ``redis://[user:password@]h1:p1``, …); any other URL alone."""
    if not is_cluster_url(url):
        return [url]
    parts = urlsplit(node_url(url))
    credentials, _, hosts = parts.netloc.rpartition("@")
    return [
        parts._replace(netloc=f"{credentials}@{host}" if credentials else host).geturl()
        for host in hosts.split(",")
    ]


def cluster_client(url: str, **kwargs) -> RedisCluster:
    """A Redis Cluster's client from a cluster URL: the nodes it names are where it first asks for the
    cluster's map (name several: one may be down)."""
    first, *others = seed_urls(url)
    seeds = [ClusterNode(urlsplit(other).hostname, urlsplit(other).port) for other in others]
    return RedisCluster.from_url(first, startup_nodes=seeds or None, **kwargs)


def connect(url: str, **kwargs) -> aioredis.Redis:
    """A client of the Redis (or, for a ``redis+cluster://`` URL, the Redis Cluster) at `url`."""
    if is_cluster_url(url):
        return cluster_client(
            url,
            retry=Retry(ExponentialBackoff(cap=BACKOFF_MAX_S, base=0.05), retries=5),
            # a master killed: its replica takes over within the cluster's node timeout (a few seconds)
            cluster_error_retry_attempts=8,
            **kwargs,
        )
    return aioredis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=BACKOFF_MAX_S, base=0.05), retries=5),
        retry_on_error=[ConnectionError, TimeoutError],
        health_check_interval=30,
        **kwargs,
    )


def is_cluster(client) -> bool:
    return isinstance(client, RedisCluster)


def publish(target, channel: str, message: bytes | str, *, sharded: bool = False):
    """PUBLISH (or, `sharded`, SPUBLISH: the message goes only to the shard holding the channel's
    slot) on a client or queued on a pipeline; redis-py's cluster client has no `publish`."""
    return target.execute_command("SPUBLISH" if sharded else "PUBLISH", channel, message)


@asynccontextmanager
async def atomic(client):
    """A pipeline whose commands run as one MULTI/EXEC on one Redis; on a cluster, a plain pipeline
    (redis-py's asyncio cluster client has no transactions): each command atomic, the group not."""
    async with client.pipeline(transaction=not is_cluster(client)) as pipe:
        yield pipe


def node_client(cluster: RedisCluster, host: str, port: int) -> aioredis.Redis:
    """A plain client of one node of `cluster`, with the cluster client's credentials and TLS, and no
    retry of its own (pub/sub must see every broken connection)."""
    given = cluster.nodes_manager.connection_kwargs
    return aioredis.Redis(
        host=host,
        port=port,
        username=given.get("username"),
        password=given.get("password"),
        ssl=issubclass(given["connection_class"], SSLConnection),
        socket_connect_timeout=2.0,
        socket_keepalive=True,
    )


async def broadcast_client(client, url: str) -> aioredis.Redis:
    """A plain client for SUBSCRIBE to broadcast channels (`Keys.cancel`): the Redis itself, or on a
    cluster any master that answers (a cluster passes every PUBLISH to all its nodes)."""
    if not is_cluster(client):
        return aioredis.Redis.from_url(url, socket_connect_timeout=2.0, socket_keepalive=True)
    await client.initialize()
    for node in client.get_primaries():
        plain = node_client(client, node.host, node.port)
        try:
            await plain.ping()
            return plain
        except (ConnectionError, TimeoutError, OSError):
            await plain.aclose()
    raise ConnectionError("no master of the Redis Cluster answers")


def redact(url: str) -> str:
    """The URL with its password hidden, for log lines and messages."""
    parts = urlsplit(url)
    return url.replace(f":{parts.password}@", ":***@") if parts.password else url


def broker_error(exc: RedisError, doing: str = "") -> BrokerUnavailable:
    """The 503 a client gets for a Redis failure, naming the cause: Redis out of memory, a read-only
    replica, a disk Redis cannot write to, or Redis unreachable. `doing`: what failed, for the message."""
    what = f"{doing}: " if doing else ""
    if isinstance(exc, OutOfMemoryError):
        return BrokerOutOfMemory(
            f"{what}Redis refuses writes: it is out of memory (used memory > maxmemory); "
            "an operator must free some (delete files, finished batches) or raise maxmemory"
        )
    if isinstance(exc, ReadOnlyError):
        return BrokerReadOnly(
            f"{what}Redis refuses writes: it is a read-only replica; point CORTEX_REDIS_URL at "
            "the primary"
        )
    if str(exc).startswith("MISCONF"):
        return BrokerCannotPersist(
            f"{what}Redis refuses writes: it cannot save to disk (MISCONF); an operator must "
            "check its disk and log"
        )
    unavailable = (
        RedisUnreachable if isinstance(exc, ConnectionError | TimeoutError) else BrokerUnavailable
    )
    return unavailable(
        f"{what}Redis is unavailable: {str(exc)[:MESSAGE_CHARS] or type(exc).__name__}"
    )


class Outage:
    """One loop's view of Redis going away: its first failure is logged (a warning), the retries are
    not, and Redis answering again is (once)."""

    def __init__(self, log: logging.Logger, what: str):
        self.log, self.what = log, what
        self.since: float | None = None  # monotonic time of the first failure of this outage

    def failed(self, exc: BaseException) -> None:
        if self.since is None:
            self.since = time.monotonic()
            self.log.warning(
                "%s failed: %s; retrying quietly until it works",
                self.what,
                str(exc) or type(exc).__name__,
            )

    def ok(self) -> bool:
        """Call after a success; True when it ends an outage."""
        if self.since is None:
            return False
        self.log.info("%s works again after %.1fs", self.what, time.monotonic() - self.since)
        self.since = None
        return True
