"""One process per node name (node_agent/serving/agent.py calls `claim` before it reads a job or
beats): a node agent started under a name whose heartbeat (shared/heartbeat.py) another process is
still refreshing refuses to start, naming that process's host, pid and the heartbeat's age. Two
processes under one name would take each other's running jobs for a dead predecessor's and
overwrite each other's heartbeats.

Each process draws an instance id at start and beats with it. A heartbeat under the name with
another instance id is either a live twin's or a dead predecessor's (a crash or a kill leaves it
until its TTL): the claim watches it until it is refreshed (a live twin: refused) or expires (a
dead one: the name is ours, and `_recover_predecessor` settles what it left). A clean shutdown
deletes the heartbeat, so only a restart after a crash waits, at most `heartbeat_ttl_s`."""

import asyncio
import logging
import time

import redis.asyncio as aioredis

from shared.heartbeat import NodeHeartbeat
from shared.keys import Keys

log = logging.getLogger(__name__)


class NodeNameTaken(RuntimeError):
    """Another live process beats under this node name."""


async def _beat(redis: aioredis.Redis, keys: Keys, name: str) -> NodeHeartbeat | None:
    fields = await redis.hgetall(keys.node(name))
    try:
        return NodeHeartbeat.from_hash(fields) if fields else None
    except ValueError:
        return None  # unreadable: nobody we could name, and no process of this version


async def claim(redis: aioredis.Redis, keys: Keys, name: str, ttl_s: float, poll_s: float) -> None:
    """Return once no other live process beats under `name`; NodeNameTaken when one does."""
    first = await _beat(redis, keys, name)
    if first is None:
        return
    log.info(
        "a heartbeat under %s from %s (pid %d) is %.1f s old: waiting to see whether it is "
        "refreshed (a live node) or expires (a stopped one), at most %.0f s",
        name,
        first.host or "an unnamed host",
        first.pid,
        _age_s(first),
        ttl_s,
    )
    deadline = time.monotonic() + ttl_s + poll_s
    while time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
        now = await _beat(redis, keys, name)
        if now is None:
            log.info("the heartbeat under %s expired: a node that stopped; taking the name", name)
            return
        if now.instance != first.instance or now.heartbeat_ms != first.heartbeat_ms:
            raise NodeNameTaken(
                f"node name {name!r} is taken: a node agent on {now.host or 'an unnamed host'} "
                f"(pid {now.pid}) beats under it, its heartbeat {_age_s(now):.1f} s old; give this "
                "one another name (CORTEX_NODE_NAME), or stop that one"
            )
    log.warning(
        "the heartbeat under %s was not refreshed in %.0f s and did not expire; taking the name",
        name,
        ttl_s,
    )


def _age_s(beat: NodeHeartbeat) -> float:
    return max(time.time() * 1000 - beat.heartbeat_ms, 0) / 1000
