"""The fleet as the gateway sees it: live nodes and the models they serve, read from heartbeats
(`cortex:nodes` zset of node → last heartbeat ms; `cortex:node:{node}` hashes)."""

import logging
import time

import redis.asyncio as aioredis
from pydantic import ValidationError

from shared.heartbeat import NodeHeartbeat
from shared.keys import Keys

log = logging.getLogger(__name__)

SERVED_CACHE_S = 1.0  # a positive answer of `is_served` is reused this long; a negative never


class Fleet:
    def __init__(self, redis: aioredis.Redis, keys: Keys, node_ttl_s: float):
        self._redis = redis
        self._keys = keys
        self._node_ttl_s = node_ttl_s
        self._served_until: dict[str, float] = {}  # model id -> monotonic deadline

    async def live_nodes(self) -> list[NodeHeartbeat]:
        """Nodes whose last heartbeat is newer than `node_ttl_s`, in name order."""
        since_ms = int((time.time() - self._node_ttl_s) * 1000)
        names = await self._redis.zrangebyscore(self._keys.nodes(), since_ms, "+inf")
        if not names:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(self._keys.node(name.decode()))
            hashes = await pipe.execute()
        nodes = []
        for name, fields in zip(names, hashes):
            if not fields:  # the hash expired or the node shut down cleanly
                continue
            try:
                node = NodeHeartbeat.from_hash(fields)
            except (ValidationError, ValueError) as exc:
                log.warning("ignoring node %s: unreadable heartbeat: %s", name.decode(), exc)
                continue
            if node.heartbeat_ms >= since_ms:
                nodes.append(node)
        return sorted(nodes, key=lambda node: node.node)

    async def serving_nodes(self) -> list[NodeHeartbeat]:
        """Live nodes that take new jobs (not draining)."""
        return [node for node in await self.live_nodes() if node.state != "draining"]

    async def node(self, name: str) -> NodeHeartbeat | None:
        fields = await self._redis.hgetall(self._keys.node(name))
        return NodeHeartbeat.from_hash(fields) if fields else None

    async def is_served(self, model: str, *, fresh: bool = False) -> bool:
        """Some live, active node has `model` ready or loading (a yes is reused for a second)."""
        if not fresh and self._served_until.get(model, 0.0) > time.monotonic():
            return True
        served = any(node.serves(model) and node.state == "active" for node in await self.live_nodes())
        if served:
            self._served_until[model] = time.monotonic() + SERVED_CACHE_S
        return served


def describe(nodes: list[NodeHeartbeat]) -> str:
    """`node-a (draining; SmolLM2 poisoned), node-b (no models)` — for error messages."""
    if not nodes:
        return "none (no node agent has sent a recent heartbeat)"
    parts = []
    for node in nodes:
        models = ", ".join(f"{model} {info.state}" for model, info in node.models.items()) or "no models"
        parts.append(f"{node.node} ({'draining; ' if node.state == 'draining' else ''}{models})")
    return ", ".join(parts)
