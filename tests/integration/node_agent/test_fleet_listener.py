"""The node's pub/sub listener against a real Redis: the newcomers' channels it holds follow the
models served here, whenever `hear` comes (before, during or after its connect) and after Redis drops
its connection."""

import asyncio

import pytest
import redis.asyncio as aioredis

from node_agent.serving.fleet_listener import FleetListener
from shared.keys import Keys
from tests.conftest import eventually


@pytest.fixture
async def listening(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    keys, heard = Keys(), []

    async def cancel(job: str) -> None:
        heard.append(("cancel", job))

    listener = FleetListener(
        client, redis_url, keys, cancel, lambda model: heard.append(("newcomer", model))
    )
    task = asyncio.create_task(listener.run())
    yield listener, client, keys, heard
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await client.aclose()


async def subscribers(client, channel: str) -> int:
    return dict(await client.pubsub_numsub(channel))[channel.encode()]


async def test_models_heard_while_the_listener_connects_are_followed(listening):
    """A node's first heartbeat names its models while the listener is still connecting: that
    listener used to subscribe with the models it knew when its SUBSCRIBE left, and never after."""
    listener, client, keys, heard = listening
    await listener.hear([])  # the first beat: nothing loaded yet
    await listener.hear(["m"])  # the next, in the same moment: the listener has not connected
    await eventually(lambda: subscribers(client, keys.newcomers("m")), what="m's newcomers heard")
    await client.publish(keys.newcomers("m"), "m")
    await client.publish(keys.cancel(), "job-1")
    await eventually(lambda: len(heard) == 2, what="both messages")
    assert heard == [("newcomer", "m"), ("cancel", "job-1")]


async def test_the_channels_follow_the_models_and_survive_a_dropped_link(listening):
    listener, client, keys, heard = listening
    await eventually(lambda: subscribers(client, keys.cancel()), what="the listener connected")
    await listener.hear(["a", "b"])
    await eventually(lambda: subscribers(client, keys.newcomers("b")), what="b's newcomers heard")
    await listener.hear(["b"])  # a unloaded
    await eventually(
        lambda: _not(subscribers(client, keys.newcomers("a"))), what="a's newcomers left"
    )
    await client.client_kill_filter(_type="pubsub")  # Redis drops the listener's link
    await eventually(
        lambda: subscribers(client, keys.newcomers("b")), 10, "b's newcomers heard again"
    )
    assert await subscribers(client, keys.newcomers("a")) == 0
    await client.publish(keys.newcomers("b"), "b")
    await eventually(lambda: ("newcomer", "b") in heard, what="b's newcomer")


async def _not(count) -> bool:
    return not await count
