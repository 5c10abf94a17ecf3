"""Queue depth counts what really waits: a withdrawn entry leaves the group's `lag` at 1 with
nothing in the stream, and neither `cortex status` nor the janitor may see a job there."""

import pytest
import redis
import redis.asyncio as aioredis

from shared import queues
from shared.fleet import Fleet
from shared.keys import CONSUMER_GROUP, Keys

pytestmark = pytest.mark.integration
KEYS = Keys()


async def test_a_withdrawn_entry_is_no_waiting_job(redis_url):
    client, stream = redis.Redis.from_url(redis_url), KEYS.jobs("m")
    client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    first = client.xadd(stream, {"job": "1"})
    client.xreadgroup(CONSUMER_GROUP, "n1", {stream: ">"}, count=1)  # delivered to a node
    withdrawn = client.xadd(stream, {"job": "2"})
    client.xdel(stream, withdrawn)  # taken back before any node read it
    client.xack(stream, CONSUMER_GROUP, first)
    client.xdel(stream, first)  # the node finished it
    assert client.xlen(stream) == 0 and client.xinfo_groups(stream)[0]["lag"] == 1  # the phantom
    async with aioredis.Redis.from_url(redis_url) as async_client:
        depth = await queues.depth(async_client, KEYS, "m")
        status = await Fleet(async_client, KEYS, node_ttl_s=8).queues(
            {"m"}, []
        )  # what `cortex status` shows
    assert depth["queued"] == {"interactive": 0, "batch": 0} and depth["running"] == 0
    assert sum(status[0].queued.values()) == 0 and status[0].running == 0
