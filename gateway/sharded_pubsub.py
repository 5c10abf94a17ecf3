"""Sharded pub/sub on a Redis Cluster, seen as one connection: the event router's view of a
cluster (gateway/events.py).

Nodes SPUBLISH a job's events to the shard that holds the slot of its channel
(`Keys.events`), so they cross one shard instead of being broadcast to every node of the
cluster. This keeps ONE connection per master (redis-py 5's asyncio cluster client has no
pub/sub) and SSUBSCRIBEs each channel on its slot's master. It answers what the router calls on a
`redis.asyncio.client.PubSub`, with ``smessage`` / ``ssubscribe`` reported as ``message`` /
``subscribe``. Any shard's connection breaking, or a shard unsubscribing a channel that nobody
asked it to drop (its slot moved to another master), ends the whole connection: the router
reconnects, reading the cluster's map again, as it does when a single Redis goes away.
"""

import asyncio

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError

from shared.redis_conn import node_client

_RENAMED = {"smessage": "message", "ssubscribe": "subscribe", "sunsubscribe": "unsubscribe"}


class ShardedPubSub:
    def __init__(self, cluster: RedisCluster):
        self._cluster = cluster
        self._shards: dict[str, tuple[aioredis.Redis, PubSub]] = {}  # master name -> its client, pub/sub
        self._readers: list[asyncio.Task] = []
        self._inbox: asyncio.Queue[dict | BaseException] = asyncio.Queue()
        self._dropping: set[bytes] = set()  # channels we asked a shard to unsubscribe

    async def connect(self) -> None:
        await self._cluster.initialize()
        for node in self._cluster.get_primaries():
            client = node_client(self._cluster, node.host, node.port)
            pubsub = client.pubsub()
            self._shards[node.name] = (client, pubsub)
            await pubsub.connect()
        self._readers = [asyncio.create_task(self._read(pubsub), name=f"sharded-pubsub-{name}")
                         for name, (_, pubsub) in self._shards.items()]

    def _pubsub_of(self, channel: bytes) -> PubSub:
        name = self._cluster.get_node_from_key(channel).name
        if name not in self._shards:  # the map changed since we connected: start again
            raise ConnectionError(f"the Redis Cluster's master for {channel.decode()} is new to this connection")
        return self._shards[name][1]

    async def subscribe(self, *channels: bytes) -> None:
        for channel in channels:  # one per command: SSUBSCRIBE's channels must share a slot
            self._dropping.discard(channel)
            await self._pubsub_of(channel).execute_command("SSUBSCRIBE", channel)

    async def unsubscribe(self, channel: bytes) -> None:
        self._dropping.add(channel)
        await self._pubsub_of(channel).execute_command("SUNSUBSCRIBE", channel)

    async def get_message(self, timeout: float) -> dict | None:
        try:
            item = await asyncio.wait_for(self._inbox.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    async def ping(self) -> None:
        for _, pubsub in self._shards.values():
            await pubsub.ping()

    async def aclose(self) -> None:
        for reader in self._readers:
            reader.cancel()
        for client, pubsub in self._shards.values():
            for closing in (pubsub, client):
                try:
                    await closing.aclose()
                except (ConnectionError, OSError):
                    pass
        self._shards.clear()

    async def _read(self, pubsub: PubSub) -> None:
        try:
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is None:
                    continue
                kind = message["type"] = _RENAMED.get(message["type"], message["type"])
                if kind == "unsubscribe" and message["channel"] not in self._dropping:
                    raise ConnectionError(f"the Redis Cluster moved {message['channel'].decode()} to another shard")
                if kind == "unsubscribe":
                    self._dropping.discard(message["channel"])
                self._inbox.put_nowait(message)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the router's next read raises it and reconnects
            self._inbox.put_nowait(exc)
