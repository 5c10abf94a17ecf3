"""One process per node name (node_agent/serving/node_identity.py): a second node agent started under
a live node's name refuses to start, naming the other's host, pid and heartbeat age, and leaves the
live node's heartbeat and jobs alone; a node restarted after a crash (its predecessor's heartbeat
still there, no longer refreshed) starts once that heartbeat expires."""

import asyncio
import os
import socket
import time

import pytest
import redis.asyncio as aioredis

from node_agent.serving.agent import NodeAgent
from node_agent.serving.node_identity import NodeNameTaken
from shared.heartbeat import NodeHeartbeat
from shared.keys import Keys
from shared.settings import NodeSettings
from tests.integration.node_agent.test_replica_lifecycle import catalogue, running_agent

pytestmark = pytest.mark.integration

FAST = dict(models=[], heartbeat_s=0.2, heartbeat_ttl_s=1.5)


async def _heartbeat(r: aioredis.Redis, name: str) -> NodeHeartbeat | None:
    fields = await r.hgetall(Keys().node(name))
    return NodeHeartbeat.from_hash(fields) if fields else None


async def test_a_second_agent_under_a_live_nodes_name_refuses_to_start(
    redis_url, tiny_dirs, tmp_path
):
    r = aioredis.Redis.from_url(redis_url)
    settings = catalogue(tmp_path, "twin", tiny_dirs["llama"]) | FAST
    async with running_agent(redis_url, **settings) as first:
        while (beat := await _heartbeat(r, "twin")) is None:
            await asyncio.sleep(0.05)
        second = NodeAgent(NodeSettings(redis_url=redis_url, **settings))
        with pytest.raises(NodeNameTaken) as refused:
            await asyncio.wait_for(second.run(), 10)
        said = str(refused.value)
        assert f"on {socket.gethostname()} (pid {os.getpid()})" in said and "s old" in said
        beat = await _heartbeat(r, "twin")
        assert beat.instance == first.instance != second.instance  # never overwritten
    await r.aclose()


async def test_a_node_restarted_after_a_crash_starts_once_the_old_heartbeat_expires(
    redis_url, tiny_dirs, tmp_path
):
    r = aioredis.Redis.from_url(redis_url)
    keys, now = Keys(), int(time.time() * 1000)
    crashed = NodeHeartbeat.empty("phoenix").model_copy(
        update=dict(heartbeat_ms=now, host="h", pid=1, instance="old")
    )
    await r.hset(keys.node("phoenix"), mapping=crashed.to_hash())
    await r.pexpire(keys.node("phoenix"), 1000)
    started = time.monotonic()
    async with running_agent(
        redis_url, **catalogue(tmp_path, "phoenix", tiny_dirs["llama"]) | FAST
    ) as agent:
        while (beat := await _heartbeat(r, "phoenix")) is None or beat.instance != agent.instance:
            assert time.monotonic() - started < 10, "the restarted node never beat"
            await asyncio.sleep(0.05)
        assert beat.host == socket.gethostname() and beat.pid == os.getpid()
    await r.aclose()
