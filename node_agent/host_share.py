"""Node agents on one host share its cores. Each registers in its host's set in Redis
(`Keys.host_nodes`, renewed with its heartbeat) and, unless `torch_threads` is set, runs
`cores // agents` torch threads; when agents come or go the running ones re-split at their next
beat (node_agent/serving/agent.py). Two agents each running every core on a 2-core host decoded at
80-120 ms a token instead of ~12 (OpenMP threads spin-waiting against each other at every op).

OpenMP's wait policy is read once, when torch loads its OpenMP runtime: `before_torch` (called by
`python -m node_agent` before it imports torch) registers the agent and, when it is not alone,
sets `OMP_WAIT_POLICY=PASSIVE` unless the environment sets it: its threads sleep at once at a
barrier instead of spinning. An agent alone at its start keeps OpenMP's default; one that agents
join later relies on the thread split alone. No torch here."""

import asyncio
import os
import socket
import time

import redis.asyncio as aioredis

from shared.keys import Keys
from shared.redis_conn import atomic, connect
from shared.settings import NodeSettings

# How many agents were on this host (this one included) when `before_torch` ran; 1 when it did not
# (an agent started in-process, as tests do) or could not reach Redis.
AT_START = 1
# How long `before_torch`'s mark counts before the agent's heartbeats renew it (importing torch
# and starting take seconds, more on a busy host): others count it from the start.
STARTING_S = 120.0


def node_name(settings: NodeSettings) -> str:
    """The node's name: `node_name`, else `hostname-pid` (a container's hostname is its id)."""
    return settings.node_name or f"{socket.gethostname()}-{os.getpid()}"


async def register(
    redis: aioredis.Redis, keys: Keys, name: str, ttl_s: float, ahead_s: float = 0.0
) -> int:
    """Mark `name` as a live agent on this host for `ttl_s` (and `ahead_s` more); returns how many
    live ones it has, this one too."""
    key, now = keys.host_nodes(socket.gethostname()), int(time.time() * 1000)
    ttl_ms = int(ttl_s * 1000)
    async with atomic(redis) as pipe:
        pipe.zadd(key, {name: now + int(ahead_s * 1000)})
        pipe.zremrangebyscore(key, 0, now - ttl_ms)
        pipe.pexpire(key, ttl_ms + int(STARTING_S * 1000))  # outlives any mark's count
        pipe.zcard(key)
        *_, count = await pipe.execute()
    return int(count)


async def leave(redis: aioredis.Redis, keys: Keys, name: str) -> None:
    await redis.zrem(keys.host_nodes(socket.gethostname()), name)


def before_torch(settings: NodeSettings | None = None) -> None:
    """Register this agent on its host and, when others run there, set OMP_WAIT_POLICY=PASSIVE
    (unless set) for the OpenMP runtime torch is about to load. Redis away: nothing (the heartbeat
    registers the agent later)."""
    global AT_START
    settings = settings or NodeSettings()

    async def once() -> int:
        redis = connect(settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
        try:
            return await register(
                redis, settings.keys, node_name(settings), settings.heartbeat_ttl_s, STARTING_S
            )
        finally:
            await redis.aclose()

    try:
        AT_START = asyncio.run(once())
    except Exception:  # Redis away or misconfigured: the agent says so once it runs
        return
    if AT_START > 1:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
