"""A node restarted under the same name (what a container or systemd restart does: the name comes
from the host) within the janitor's dead-node window: the entries its predecessor had read and not
finished are requeued (or failed, when they had sent output) as soon as it starts, not left pending
until their clients time out."""

import pytest
import redis.asyncio as aioredis

from shared.keys import CONSUMER_GROUP, Keys
from tests.integration.node_agent.test_replica_lifecycle import (
    catalogue,
    enqueue,
    last_events,
    running_agent,
    subscribed,
)

pytestmark = pytest.mark.integration


async def test_a_restarted_node_settles_what_its_predecessor_left(redis_url, tiny_dirs, tmp_path):
    r = aioredis.Redis.from_url(redis_url)
    keys = Keys()
    stream = keys.jobs("tiny")
    await r.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    for job in ("unstarted", "started"):
        await enqueue(r, stream, keys.events(job), job)
    await r.xreadgroup(
        CONSUMER_GROUP, "n1", {stream: ">"}, count=2
    )  # read by a node n1 that then died
    await r.sadd(keys.started("n1"), "started")  # it had streamed output of this one
    pubsub = await subscribed(r, keys, ["unstarted", "started"])
    async with running_agent(redis_url, **catalogue(tmp_path, "n1", tiny_dirs["llama"])):
        ended = await last_events(pubsub, 2)
    assert ended["unstarted"].type == "done"  # requeued, then run by the new n1
    assert ended["started"].type == "error" and ended["started"].code == "node_lost"
    assert (await r.xpending(stream, CONSUMER_GROUP))["pending"] == 0
    assert not await r.exists(keys.started("n1"))
    await r.aclose()
