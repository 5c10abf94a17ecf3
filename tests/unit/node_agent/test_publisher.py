"""The node's publisher and job reader when Redis goes away, against a real redis-server: lost events
are not sent twice, running jobs whose events were lost are reported, an ended job's acknowledgement
(with an error event for its lost ones) waits for Redis; entries Redis still holds for this node can
be listed and settled; a job's steps go to its event log, if it has one."""

import asyncio
import shutil

import pytest
import redis.asyncio as aioredis

from node_agent.serving import publisher as publisher_module
from node_agent.serving.cache_index import CacheIndex
from node_agent.serving.job_reader import JobReader
from node_agent.serving.output_messages import Outgoing
from node_agent.serving.publisher import Publisher
from shared import event_log
from shared.keys import CONSUMER_GROUP, Keys
from shared.processes import free_port, redis_answers, redis_server_argv
from shared.redis_conn import connect
from shared.wire import Pooled, StartEvent, StoredEvent, pack_event, unpack_event
from tests.conftest import Service
from tests.unit.gateway.conftest import delta, done

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]
KEYS = Keys()


class DurableServer:
    """A durable redis-server on one port, stopped and started again on the same files."""

    def __init__(self, tmp_path):
        self.port, self.tmp_path, self.starts = free_port(), tmp_path, 0
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        self.starts += 1
        argv = redis_server_argv(self.port, workdir=self.tmp_path, durable=True)
        self.server = Service("redis-server", argv, self.tmp_path / f"redis-{self.starts}.log")
        self.server.wait_ready(lambda: redis_answers(self.url))

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def server(tmp_path):
    found = DurableServer(tmp_path)
    yield found
    found.stop()


async def test_a_failed_round_trip_keeps_acks_reports_running_jobs_and_sends_nothing_twice(
    server, monkeypatch
):
    monkeypatch.setattr(
        publisher_module, "RETRY_S", 5.0
    )  # time to listen once Redis is back, before the retry
    admin = aioredis.Redis.from_url(server.url)
    stream = KEYS.jobs("m")
    await admin.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    entry = (await admin.xadd(stream, {"job": "ended"})).decode()
    await admin.xreadgroup(CONSUMER_GROUP, "node-a", {stream: ">"})
    await admin.aclose()
    client = connect(server.url)
    lost: list[str] = []
    publisher = Publisher(client, KEYS, "node-a", on_unheard=lambda job: None, on_lost=lost.append)
    publisher.start()
    server.stop()

    publisher.send(
        [
            Outgoing("cortex:events:running", [delta("lost")], job="running"),
            Outgoing("cortex:events:ended", [delta("lost too"), done()], (stream, entry), "ended"),
        ]
    )
    await asyncio.wait_for(
        publisher.flush(), 30
    )  # redis-py's retries gave up: the round trip failed
    assert lost == ["running"]
    server.start()
    listener = aioredis.Redis.from_url(server.url)
    assert (await listener.xpending(stream, CONSUMER_GROUP))[
        "pending"
    ] == 1  # the ack waits for the retry
    pubsub = listener.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe("cortex:events:ended", "cortex:events:running")

    messages = []
    async with asyncio.timeout(20):
        while not messages:
            if (message := await pubsub.get_message(timeout=0.1)) is not None:
                messages.append(message)
    await asyncio.sleep(0.3)
    while (message := await pubsub.get_message(timeout=0.1)) is not None:
        messages.append(message)
    (only,) = (
        messages  # nothing of the failed round trip again, only the ended job's error in its place
    )
    assert only["channel"] == b"cortex:events:ended"
    event = unpack_event(only["data"])
    assert (event.type, event.code) == ("error", "broker_unavailable")
    assert "node-a lost its connection to Redis" in event.message
    assert (await listener.xpending(stream, CONSUMER_GROUP))[
        "pending"
    ] == 0 and await listener.xlen(stream) == 0
    await publisher.stop()
    await client.aclose()
    await listener.aclose()


async def test_output_that_cannot_be_published_ends_its_job_with_an_error_and_settles_its_entry(
    server,
):
    """A bug on the publishing path (here an event that cannot be packed) fails the round trip's
    jobs with a clear error and still acknowledges their entries: nothing stays pending."""
    admin = aioredis.Redis.from_url(server.url)
    stream = KEYS.jobs("m")
    await admin.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    entry = (await admin.xadd(stream, {"job": "broken"})).decode()
    await admin.xreadgroup(CONSUMER_GROUP, "node-a", {stream: ">"})
    pubsub = admin.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe("cortex:events:broken")
    publisher = Publisher(connect(server.url), KEYS, "node-a", on_unheard=lambda job: None)
    publisher.start()
    publisher.send(
        [
            Outgoing(
                "cortex:events:broken", [delta("fine"), object(), done()], (stream, entry), "broken"
            )
        ]
    )
    async with asyncio.timeout(20):
        while (message := await pubsub.get_message(timeout=0.1)) is None:
            pass
    event = unpack_event(message["data"])
    assert (event.type, event.code) == (
        "error",
        "generation_failed",
    ) and "could not publish" in event.message
    assert (await admin.xpending(stream, CONSUMER_GROUP))["pending"] == 0 and await admin.xlen(
        stream
    ) == 0
    await publisher.stop()
    await admin.aclose()


async def test_the_reader_lists_and_settles_what_redis_holds_for_this_node(server):
    client = aioredis.Redis.from_url(server.url)
    reader = JobReader(client, KEYS, "m", "node-a", batch_max_wait_s=60)
    await reader.ensure_groups()
    first = (await client.xadd(KEYS.jobs("m"), {"job": "1"})).decode()
    second = (await client.xadd(KEYS.jobs("m", "batch"), {"job": "2"})).decode()
    assert [e.entry_id for e in await reader.read(free=4, batch_free=4)] == [first, second]
    other = JobReader(client, KEYS, "m", "node-b", batch_max_wait_s=60)
    third = (await client.xadd(KEYS.jobs("m"), {"job": "3"})).decode()
    await other.read(free=4, batch_free=4)

    assert sorted(await reader.pending()) == sorted(
        [(KEYS.jobs("m"), first), (KEYS.jobs("m", "batch"), second)]
    )
    await reader.settle([(KEYS.jobs("m"), first)])
    assert await reader.pending() == [(KEYS.jobs("m", "batch"), second)]
    assert [e[0].decode() for e in await client.xrange(KEYS.jobs("m"))] == [
        third
    ]  # acked and deleted
    assert (await client.xpending(KEYS.jobs("m"), CONSUMER_GROUP))["pending"] == 1  # node-b's
    await client.aclose()


async def test_a_job_with_an_event_log_gets_its_steps_appended_its_expiry_kept_and_runs_on_unheard(
    redis_url,
):
    admin = aioredis.Redis.from_url(redis_url)
    log_key = KEYS.event_log("kept")
    await admin.xadd(log_key, {event_log.RECORD: b"{}"})  # as the gateway makes it
    await admin.expire(log_key, 5)
    client = connect(redis_url)
    unheard: list[str] = []
    publisher = Publisher(client, KEYS, "node-a", on_unheard=unheard.append, retention_s=100)
    publisher.start()

    publisher.send(
        [
            Outgoing("cortex:events:kept", [StartEvent(prompt_tokens=3)], job="kept"),
            Outgoing("cortex:events:gone", [StartEvent(prompt_tokens=3)], job="gone"),
        ]
    )
    await publisher.flush()
    assert 95 <= await admin.ttl(log_key) <= 100  # its first write sets the expiry to the retention
    assert unheard == ["gone"]  # nobody listens to either; only the job without a log is cancelled
    assert not await admin.exists(KEYS.event_log("gone"))  # no log is ever made by the node

    await admin.expire(log_key, 50)
    publisher.send([Outgoing("cortex:events:kept", [delta("Hel")], job="kept")])
    await publisher.flush()
    assert 45 <= await admin.ttl(log_key) <= 50  # not due again yet: no EXPIRE this step
    stream = KEYS.jobs("m")
    await admin.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    entry = (await admin.xadd(stream, {"job": "kept"})).decode()
    await admin.xreadgroup(CONSUMER_GROUP, "node-a", {stream: ">"})
    publisher.send([Outgoing("cortex:events:kept", [delta("lo"), done()], (stream, entry), "kept")])
    await publisher.flush()
    assert 95 <= await admin.ttl(log_key) <= 100  # the end sets it once more
    entries = await admin.xrange(log_key)
    assert [fields for _, fields in entries][1:] == [  # each entry's place among the job's events
        {b"0": pack_event(StartEvent(prompt_tokens=3)), b"at": b"0"},
        {b"0": pack_event(delta("Hel")), b"at": b"1"},
        {b"0": pack_event(delta("lo")), b"1": pack_event(done()), b"at": b"2"},
    ]
    said = [event for _, fields in entries for event in event_log.events(fields)]
    assert [e.type for e in said] == ["start", "delta", "delta", "done"]
    assert "".join(e.choices[0].text for e in said if e.type == "delta") == "Hello"
    assert unheard == ["gone"] and publisher._logs == {"gone": publisher_module.NO_LOG}
    await publisher.stop()
    await client.aclose()
    await admin.aclose()


async def test_an_event_log_is_capped_however_long_its_job_runs(redis_url, monkeypatch):
    monkeypatch.setattr(event_log, "MAXLEN", 50)
    admin = aioredis.Redis.from_url(redis_url)
    log_key = KEYS.event_log("long")
    await admin.xadd(log_key, {event_log.RECORD: b"{}"})
    client = connect(redis_url)
    publisher = Publisher(client, KEYS, "node-a", on_unheard=lambda job: None)
    publisher.start()
    for i in range(1000):
        publisher.send([Outgoing("cortex:events:long", [delta(str(i))], job="long")])
    await publisher.flush()
    assert (
        50 <= await admin.xlen(log_key) <= 50 + 100
    )  # MAXLEN ~: whole nodes of 100 entries are trimmed
    assert (await admin.xrevrange(log_key, count=1))[0][1] == {
        b"0": pack_event(delta("999")),
        b"at": b"999",
    }
    await publisher.stop()
    await client.aclose()
    await admin.aclose()


async def test_the_caches_prefix_marks_ride_the_round_trips_and_wait_out_a_failed_one(server):
    client = connect(server.url)
    key = KEYS.prefixes("m", "node-a")
    admin = aioredis.Redis.from_url(server.url)
    await admin.hset(key, mapping={"stale": 1})  # an earlier engine's
    index = CacheIndex(key, ttl_ms=8000, index_key=KEYS.prefix_index("m"), node="node-a")
    publisher = Publisher(client, KEYS, "node-a", on_unheard=lambda job: None, cache_index=index)
    publisher.start()
    index.note([("a", 16), ("b", 48)], [])
    publisher.send([])
    await publisher.flush()
    assert (
        await admin.hgetall(key) == {b"a": b"16", b"b": b"48"} and 0 < await admin.pttl(key) <= 8000
    )
    await admin.aclose()
    server.stop()
    index.note([("c", 64)], ["a"])
    publisher.send([])
    await asyncio.wait_for(publisher.flush(), 30)  # failed: the changes are kept
    index.note([("a", 16)], ["c"])  # newer news of the same marks wins
    server.start()
    publisher.send([])
    await publisher.flush()
    admin = aioredis.Redis.from_url(server.url)
    assert await admin.hgetall(key) == {b"a": b"16", b"b": b"48"}
    assert await admin.hgetall(KEYS.prefix_index("m")) == {b"a@node-a": b"16", b"b@node-a": b"48"}
    await publisher.stop()
    await admin.aclose()
    await client.aclose()


async def test_an_event_over_the_bound_waits_in_the_result_hash_and_its_pointer_is_published(
    redis_url,
):
    """A done event with 40 KB of vectors, the bound 16 KB: pub/sub and the event log carry a small
    `stored` event; the event itself is in `Keys.result`, with the retention as its expiry."""
    admin = aioredis.Redis.from_url(redis_url)
    await admin.xadd(KEYS.event_log("big"), {event_log.RECORD: b"{}"})
    pubsub = admin.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe("cortex:events:big")
    client = connect(redis_url)
    publisher = Publisher(
        client, KEYS, "node-a", on_unheard=lambda job: None, retention_s=100, max_event_bytes=16384
    )
    publisher.start()
    big = done()
    big.pooled = Pooled(vectors=[bytes(400)] * 100)
    publisher.send([Outgoing("cortex:events:big", [delta("small"), big], job="big")])
    await publisher.flush()
    heard = []
    while len(heard) < 2:
        if (message := await pubsub.get_message(timeout=1.0)) is not None:
            heard.append(message["data"])
    assert unpack_event(heard[0]) == delta("small")  # under the bound: as it was
    assert len(heard[1]) < 200
    pointer = unpack_event(heard[1])
    assert isinstance(pointer, StoredEvent) and pointer.size == len(pack_event(big))
    assert unpack_event(await admin.hget(KEYS.result("big"), pointer.field)) == big
    assert 95 <= await admin.ttl(KEYS.result("big")) <= 100
    *_, (_, logged) = await admin.xrange(KEYS.event_log("big"))
    assert [e.type for e in event_log.events(logged)] == ["delta", "stored"]
    await publisher.stop()
    await pubsub.aclose()
    await client.aclose()
    await admin.aclose()


async def test_the_tiers_of_prefix_marks_kept_below_the_device_ride_beside_them(server):
    client = connect(server.url)
    key, tiers_key = KEYS.prefixes("m", "node-a"), KEYS.prefix_tiers("m", "node-a")
    admin = aioredis.Redis.from_url(server.url)
    await admin.hset(tiers_key, mapping={"stale": "disk"})  # an earlier engine's
    index = CacheIndex(
        key, ttl_ms=8000, tiers_key=tiers_key, index_key=KEYS.prefix_index("m"), node="node-a"
    )
    publisher = Publisher(client, KEYS, "node-a", on_unheard=lambda job: None, cache_index=index)
    publisher.start()
    index.note([("a", 16), ("b", 48), ("c", 64)], [])
    index.note([], [], [("a", "host"), ("b", "disk")])
    publisher.send([])
    await publisher.flush()
    assert await admin.hgetall(tiers_key) == {b"a": b"host", b"b": b"disk"}
    assert len(await admin.hgetall(key)) == 3 and 0 < await admin.pttl(tiers_key) <= 8000
    index.note([], ["b"], [("a", "device"), ("c", "host")])  # a restored, b gone, c evicted
    publisher.send([])
    await publisher.flush()
    assert await admin.hgetall(tiers_key) == {b"c": b"host"}
    assert set(await admin.hgetall(key)) == {b"a", b"c"}
    # the model's prefix index says each held mark's tier too, for routing
    assert await admin.hgetall(KEYS.prefix_index("m")) == {
        b"a@node-a": b"16",
        b"c@node-a": b"64:host",
    }
    await publisher.stop()
    await admin.aclose()
    await client.aclose()
