"""Node agents on one host share its cores (node_agent/host_share.py): one started beside another
sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (unless the environment chose), and each
runs its share of the cores, re-split when agents come or go (`torch_threads` still decides)."""

import asyncio
import os
import subprocess
import sys

import pytest
import redis.asyncio as aioredis
import torch

from node_agent import host_share
from shared.keys import Keys
from tests.integration.node_agent.test_replica_lifecycle import catalogue, running_agent

pytestmark = pytest.mark.integration

TTL_S = 1.5
CORES = len(os.sched_getaffinity(0))
SHOW = (
    "from node_agent import host_share; host_share.before_torch(); import os, torch; "
    "print(os.environ.get('OMP_WAIT_POLICY'), host_share.AT_START)"
)


def _started(redis_url: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [sys.executable, "-c", SHOW],
        env=base | {"CORTEX_REDIS_URL": redis_url, "CORTEX_NODE_NAME": "b"} | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


async def test_an_agent_started_beside_another_sets_a_passive_wait_policy(redis_url):
    r = aioredis.Redis.from_url(redis_url)
    assert _started(redis_url) == "None 1"  # alone: OpenMP's default
    await asyncio.sleep(TTL_S + 0.5)
    assert await host_share.register(r, Keys(), "a", TTL_S) == 2  # b counts while it starts
    assert _started(redis_url) == "PASSIVE 2"
    assert _started(redis_url, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE 2"  # the operator's choice
    await r.aclose()


async def _threads(agent) -> int:
    while "cpu" not in agent.threads:  # the agent is starting
        await asyncio.sleep(0.05)
    return await agent.threads["cpu"].call(torch.get_num_threads)


async def test_a_running_agent_resplits_the_cores_when_agents_come_and_go(
    redis_url, tiny_dirs, tmp_path
):
    r = aioredis.Redis.from_url(redis_url)
    settings = catalogue(tmp_path, "a", tiny_dirs["llama"]) | dict(
        models=[], heartbeat_s=0.2, heartbeat_ttl_s=TTL_S
    )
    async with running_agent(redis_url, **settings) as agent:
        for _ in range(300):  # another agent comes, and beats
            await host_share.register(r, Keys(), "sibling", TTL_S)
            if await _threads(agent) == max(1, CORES // 2) and agent.agents_here == 2:
                break
            await asyncio.sleep(0.1)
        assert agent.agents_here == 2 and await _threads(agent) == max(1, CORES // 2)
        for _ in range(300):  # and stops beating
            if agent.agents_here == 1:
                break
            await asyncio.sleep(0.1)
        assert await _threads(agent) == CORES
    async with running_agent(redis_url, **settings | dict(torch_threads=CORES)) as agent:
        for _ in range(50):
            await host_share.register(r, Keys(), "sibling", TTL_S)
            await asyncio.sleep(0.1)
        assert agent.agents_here == 2 and await _threads(agent) == CORES  # the setting decides
    members = await r.zrange(Keys().host_nodes(os.uname().nodename), 0, -1)
    assert b"a" not in members  # a stopped agent leaves the host's set
    await r.aclose()
