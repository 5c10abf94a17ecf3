"""The event router: one pub/sub connection, per-job queues, and Redis going away."""

import asyncio

import msgpack
import pytest

from gateway.bus import links as event_links
from gateway.bus.router import EventRouter
from shared.errors import BrokerUnavailable, GenerationFailed
from shared.keys import CONSUMER_GROUP
from shared.wire import DeltaEvent, pack_event
from tests.conftest import eventually
from tests.unit.gateway.conftest import delta, done


@pytest.fixture
def fast_checks(monkeypatch):
    monkeypatch.setattr(event_links, "POLL_S", 0.02)
    monkeypatch.setattr(event_links, "CONNECT_WAIT_S", 0.1)


@pytest.fixture
async def router(redis_factory):
    connects = []

    async def on_connect():
        connects.append(1)

    router = EventRouter(redis_factory, on_connect=on_connect)
    router.connects = connects
    await router.start()
    yield router
    await router.stop()


async def test_routes_each_channel_to_its_queue(router, redis):
    queue_a = await router.subscribe("cortex:events:a")
    queue_b = await router.subscribe("cortex:events:b")
    assert await redis.pubsub_numsub("cortex:events:a", "cortex:events:b") == [
        (b"cortex:events:a", 1),
        (b"cortex:events:b", 1),
    ]  # confirmed by Redis before subscribe() returned
    await redis.publish("cortex:events:b", pack_event(delta("for b")))
    await redis.publish("cortex:events:a", pack_event(done()))
    await redis.publish("cortex:events:nobody", pack_event(delta("dropped")))
    assert (await asyncio.wait_for(queue_b.get(), 1)).choices[0].text == "for b"
    assert (await asyncio.wait_for(queue_a.get(), 1)).type == "done"
    assert queue_a.empty() and queue_b.empty()
    assert router.in_flight == 2


async def listeners(redis, channel: str, count: int) -> bool:
    return await redis.pubsub_numsub(channel) == [(channel.encode(), count)]


async def test_unsubscribe(router, redis):
    queue = await router.subscribe("cortex:events:a")
    await router.unsubscribe("cortex:events:a", queue)
    await router.unsubscribe("cortex:events:a", queue)  # twice is fine
    await eventually(lambda: listeners(redis, "cortex:events:a", 0), 2, "the channel unsubscribed")
    assert router.in_flight == 0


async def test_several_listeners_of_one_job_each_hear_it_and_the_last_unsubscribes(router, redis):
    first = await router.subscribe("cortex:events:a")
    second = await router.subscribe("cortex:events:a")  # a client resuming it on the same replica
    assert await redis.pubsub_numsub("cortex:events:a") == [
        (b"cortex:events:a", 1)
    ]  # one subscription
    await redis.publish("cortex:events:a", pack_event(delta("both")))
    for queue in (first, second):
        assert (await asyncio.wait_for(queue.get(), 1)).choices[0].text == "both"
    await router.unsubscribe("cortex:events:a", first)
    await redis.publish("cortex:events:a", pack_event(delta("still")))
    assert (await asyncio.wait_for(second.get(), 1)).choices[0].text == "still"
    assert first.empty()
    await router.unsubscribe("cortex:events:a", second)
    await eventually(lambda: listeners(redis, "cortex:events:a", 0), 2, "the channel unsubscribed")


async def test_unreadable_event_fails_the_job_clearly(router, redis):
    queue = await router.subscribe("cortex:events:a")
    await redis.publish("cortex:events:a", msgpack.packb({"v": 99, "type": "delta", "choices": []}))
    item = await asyncio.wait_for(queue.get(), 1)
    assert isinstance(item, GenerationFailed) and "wire version 99" in item.message


async def test_one_connection_for_many_jobs(redis_factory, redis):
    made = []
    router = EventRouter(lambda: made.append(redis_factory()) or made[-1])
    await router.start()
    queues = [await router.subscribe(f"cortex:events:{i}") for i in range(20)]
    for i in range(20):
        await redis.publish(f"cortex:events:{i}", pack_event(delta(str(i))))
    assert [(await asyncio.wait_for(q.get(), 1)).choices[0].text for q in queues] == [
        str(i) for i in range(20)
    ]
    assert len(made) == 1
    await router.stop()


async def test_redis_going_away_fails_in_flight_jobs_then_recovers(
    fast_checks, router, fake_server, redis
):
    queue = await router.subscribe("cortex:events:a")
    fake_server.connected = False
    item = await asyncio.wait_for(queue.get(), 2)
    assert isinstance(item, BrokerUnavailable) and item.status == 503
    with pytest.raises(BrokerUnavailable):
        await router.subscribe("cortex:events:b")
    fake_server.connected = True
    await eventually(lambda: router.connected, 5, "the router reconnected")
    assert len(router.connects) == 2  # the on-connect hook ran again (catalogue rewritten)
    queue = await router.subscribe("cortex:events:c")
    await redis.publish("cortex:events:c", pack_event(delta("back")))
    assert isinstance(await asyncio.wait_for(queue.get(), 1), DeltaEvent)


async def test_stop_fails_jobs_in_flight(redis_factory):
    router = EventRouter(redis_factory)
    await router.start()
    queue = await router.subscribe("cortex:events:a")
    await router.stop()
    assert isinstance(queue.get_nowait(), BrokerUnavailable)


async def queued_job(router, redis, channel: str, *, read: bool = False) -> asyncio.Queue:
    """A job subscribed, enqueued and tracked as the gateway does it (read by a node when `read`)."""
    queue = await router.subscribe(channel)
    if not await redis.exists("cortex:jobs:m"):
        await redis.xgroup_create("cortex:jobs:m", CONSUMER_GROUP, id="0", mkstream=True)
    entry_id = (await redis.xadd("cortex:jobs:m", {"job": channel})).decode()
    router.track(channel, "cortex:jobs:m", entry_id)
    if read:
        await redis.xreadgroup(CONSUMER_GROUP, "node-a", {"cortex:jobs:m": ">"}, count=1)
    return queue


async def test_a_queued_job_waits_for_redis_and_is_served_when_its_entry_is_still_there(
    fast_checks, router, fake_server, redis
):
    waiting = await queued_job(router, redis, "cortex:events:w")
    running = await router.subscribe("cortex:events:r")
    await redis.publish("cortex:events:r", pack_event(delta("heard")))
    assert isinstance(await asyncio.wait_for(running.get(), 1), DeltaEvent)

    fake_server.connected = False
    assert isinstance(
        await asyncio.wait_for(running.get(), 2), BrokerUnavailable
    )  # its events may be lost
    await asyncio.sleep(0.2)
    assert waiting.empty()  # the queued one waits
    fake_server.connected = True
    await eventually(
        lambda: router.connected and not router.queued._checks, 5, "the queued job checked again"
    )
    await redis.publish("cortex:events:w", pack_event(delta("served")))
    assert (await asyncio.wait_for(waiting.get(), 1)).choices[0].text == "served"


async def test_a_queued_job_whose_entry_was_lost_or_read_meanwhile_fails(
    fast_checks, router, fake_server, redis
):
    lost = await queued_job(router, redis, "cortex:events:lost")
    read = await queued_job(router, redis, "cortex:events:read", read=True)
    await redis.delete("cortex:jobs:m")  # as a Redis that kept nothing
    await redis.xgroup_create("cortex:jobs:m", CONSUMER_GROUP, id="0", mkstream=True)
    read_late = await queued_job(router, redis, "cortex:events:late", read=True)

    fake_server.connected = False
    await asyncio.sleep(0.3)
    fake_server.connected = True
    await eventually(lambda: router.connected, 5, "the router reconnected")
    for queue in (
        lost,
        read,
        read_late,
    ):  # read 0.3 s before the router listened again: its events may be lost
        item = await asyncio.wait_for(queue.get(), 2)
        assert (
            isinstance(item, BrokerUnavailable)
            and "lost or read while Redis restarted" in item.message
        )


async def test_a_queued_job_fails_when_redis_stays_away(
    fast_checks, redis_factory, fake_server, redis
):
    router = EventRouter(redis_factory, outage_wait_s=0.3)
    await router.start()
    queue = await queued_job(router, redis, "cortex:events:w")
    fake_server.connected = False
    item = await asyncio.wait_for(queue.get(), 5)
    assert isinstance(item, BrokerUnavailable) and "did not come back within 0.3s" in item.message
    fake_server.connected = True
    await router.stop()


async def test_a_shard_back_from_a_failover_fails_the_queued_jobs_whose_entries_it_lost(
    router, redis
):
    """On a cluster a job's stream and its events channel may live on different shards: when the
    stream's shard comes back (its replica promoted), a queued job whose entry the replica never got
    fails at once rather than wait for its request's timeout; the others wait on."""
    kept = await queued_job(router, redis, "cortex:events:kept")
    lost = await queued_job(router, redis, "cortex:events:lost")
    await redis.xdel(
        "cortex:jobs:m", router.queued.entries[b"cortex:events:lost"][1]
    )  # a write the replica never got
    await router.queued.check_after_failover(
        event_links.Link(0, frozenset(range(16384))), redis
    )  # the stream's shard, back
    item = lost.get_nowait()
    assert (
        isinstance(item, BrokerUnavailable) and "lost when its Redis master failed" in item.message
    )
    assert kept.empty()


async def test_a_request_waiting_for_a_link_in_backoff_makes_it_try_again_at_once(
    fast_checks, monkeypatch, router, fake_server, redis
):
    """Redis back while the router sleeps a long backoff (1.6 s after a few failed tries): a new job
    does not get a 503 for the rest of that sleep; its wait makes the router try again at once."""
    monkeypatch.setattr(event_links, "CONNECT_WAIT_S", 1.0)
    fake_server.connected = False
    await asyncio.sleep(
        3.4
    )  # the tries after 0.05, 0.1, 0.2, 0.4, 0.8 s failed: the next comes 1.6 s later
    fake_server.connected = True
    queue = await router.subscribe("cortex:events:back")
    await redis.publish("cortex:events:back", pack_event(delta("back")))
    assert isinstance(await asyncio.wait_for(queue.get(), 1), DeltaEvent)
