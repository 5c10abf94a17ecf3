"""Priority classes on a real redis-server (the node's reader, queue positions), and batch line
parsing and file limits (no I/O)."""

import json
import time

import pytest
import redis.asyncio as aioredis

from gateway.batch.lines import LineError, parse_line
from gateway.stores.files import check_batch_input
from node_agent.serving.job_reader import JobReader
from shared import queues
from shared.errors import InvalidRequest, PayloadTooLarge
from shared.keys import CONSUMER_GROUP, Keys

KEYS = Keys()
M = "m"


@pytest.fixture
async def r(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    for _, stream in queues.streams(KEYS, M, nodes=("n1", "n2")):
        await client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    yield client
    await client.aclose()


async def add(r, job_class: str, band: str, job: str) -> str:
    return (await r.xadd(KEYS.jobs(M, job_class, band), {"job": job})).decode()


async def test_interactive_first_then_bands_and_batch_capped(r):
    await add(r, "batch", "normal", "b1")
    await add(r, "batch", "high", "bh")
    await add(r, "interactive", "low", "il")
    await add(r, "interactive", "normal", "i1")
    await add(r, "interactive", "high", "ih")
    reader = JobReader(r, KEYS, M, "n1", batch_max_wait_s=60)
    got = await reader.read(free=4, batch_free=1)
    assert [e.fields[b"job"] for e in got] == [b"ih", b"i1", b"il", b"bh"]
    assert [e.job_class for e in got] == ["interactive"] * 3 + ["batch"]
    assert [e.fields[b"job"] for e in await reader.read(free=4, batch_free=4)] == [b"b1"]


async def test_a_batch_line_past_its_max_wait_goes_first(r):
    await add(r, "batch", "normal", "old")
    time.sleep(0.06)
    await add(r, "interactive", "normal", "new")
    reader = JobReader(r, KEYS, M, "n1", batch_max_wait_s=0.05)
    assert [e.fields[b"job"] for e in await reader.read(free=1, batch_free=1)] == [b"old"]


async def test_queue_position_counts_more_urgent_streams_and_withdraw(r):
    script = r.register_script(queues.QUEUE_POSITION_LUA)
    stream = KEYS.jobs(M)
    await add(r, "interactive", "high", "h")
    first = await add(r, "interactive", "normal", "a")
    mine = await add(r, "interactive", "normal", "b")
    await add(r, "batch", "normal", "x")  # batch never counts ahead of interactive
    ahead = queues.streams_before(KEYS, stream)

    async def position(entry, take_back="0"):
        return await script(keys=[stream, *ahead], args=[entry, CONSUMER_GROUP, 1000, take_back])

    assert await position(mine) == 3
    await JobReader(r, KEYS, M, "n1", 60).read(free=2, batch_free=0)  # takes h and a
    assert await position(mine) == 1 and await position(first) == 0
    assert (
        await position(mine, "1") == 1 and await r.xlen(stream) == 1
    )  # withdrawn: only `a` is left


async def test_a_routed_job_keeps_its_position_and_can_be_withdrawn_once_moved(r):
    from gateway.jobs.queue import _position

    own = KEYS.node_jobs(M, "n1")
    mine = (await r.xadd(own, {"job": "mine"})).decode()
    moved = await r.register_script(queues.MOVE_LUA)(
        keys=[own, KEYS.moved_jobs(M)], args=[CONSUMER_GROUP, "+", 100, "1"]
    )
    assert moved == 1 and not await r.exists(own)
    assert await _position(r, KEYS, own, mine, take_back=False) == 1  # first on the moved stream
    assert await _position(r, KEYS, own, mine, take_back=True) == 1
    assert await r.xlen(KEYS.moved_jobs(M)) == 0  # withdrawn from where the janitor put it
    assert await _position(r, KEYS, own, mine, take_back=False) == 0


async def test_own_stream_first_then_moved_and_shared_oldest_first(r):
    """Within a band a node takes its own stream's jobs first, then the moved and shared streams'
    by age (a moved job keeps the place its first entry id gives it); the band order still holds."""
    await add(r, "interactive", "normal", "s-old")
    moved_id = (
        await r.xadd(KEYS.jobs(M), {"job": "tmp"})
    ).decode()  # an id between the two shared jobs
    await r.xdel(KEYS.jobs(M), moved_id)
    await add(r, "interactive", "normal", "s-new")
    await r.xadd(KEYS.moved_jobs(M), {"job": "moved"}, id=moved_id)
    await r.xadd(KEYS.node_jobs(M, "n1"), {"job": "mine"})
    await r.xadd(KEYS.node_jobs(M, "n2"), {"job": "theirs"})
    await r.xadd(KEYS.node_jobs(M, "n1", "interactive", "low"), {"job": "mine-low"})
    await add(r, "interactive", "high", "high")
    reader = JobReader(r, KEYS, M, "n1", batch_max_wait_s=60)
    got = await reader.read(free=10, batch_free=0)
    assert [e.fields[b"job"] for e in got] == [
        b"high",
        b"mine",
        b"s-old",
        b"moved",
        b"s-new",
        b"mine-low",
    ]
    assert await r.xlen(KEYS.node_jobs(M, "n2")) == 1  # another node's own stream is not read here


def test_bands_and_stream_names():
    assert queues.parse(KEYS, "cortex:jobs:a:b:batch:high:@n-1") == queues.StreamName(
        "a:b", "batch", "high", "n-1"
    )
    assert queues.parse(KEYS, "cortex:jobs:a:moved") == queues.StreamName(
        "a", "interactive", "normal", moved=True
    )
    assert queues.streams_before(KEYS, KEYS.node_jobs(M, "n1", "interactive", "low")) == [
        KEYS.node_jobs(M, "n1", "interactive", "high"),
        KEYS.moved_jobs(M, "interactive", "high"),
        KEYS.jobs(M, "interactive", "high"),
        KEYS.node_jobs(M, "n1"),
        KEYS.moved_jobs(M),
        KEYS.jobs(M),
    ]
    assert [queues.band(p) for p in (-5, 0, None, 3)] == ["high", "normal", "normal", "low"]
    assert KEYS.jobs(M) == "cortex:jobs:m" and KEYS.jobs(M, "batch") == "cortex:jobs:m:batch"
    assert queues.model_of(KEYS, "cortex:jobs:a:b:batch:high") == "a:b"
    assert queues.model_of(KEYS, "cortex:jobs:a:b") == "a:b"


def test_line_parsing_fails_only_that_line():
    good = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    }
    parsed = parse_line(json.dumps(good).encode(), "/v1/chat/completions")
    assert parsed.custom_id == "c" and parsed.body.stream is False
    for raw, code in [
        (b"{nope", "invalid_json"),
        (b"[]", "invalid_request"),
        (json.dumps(good | {"custom_id": ""}).encode(), "missing_custom_id"),
        (json.dumps(good | {"url": "/v1/completions"}).encode(), "invalid_url"),
        (json.dumps(good | {"body": {"model": "m"}}).encode(), "invalid_request"),
    ]:
        with pytest.raises(LineError) as caught:
            parse_line(raw, "/v1/chat/completions")
        assert caught.value.code == code


def test_file_limits():
    check_batch_input(b'{"a": 1}\n{"b": 2}\n', max_bytes=100, max_lines=2)
    with pytest.raises(PayloadTooLarge, match="limit is 10 bytes"):
        check_batch_input(b"x" * 11, max_bytes=10, max_lines=5)
    with pytest.raises(PayloadTooLarge, match="limit is 1 lines"):
        check_batch_input(b"{}\n{}\n", max_bytes=100, max_lines=1)
    with pytest.raises(InvalidRequest):
        check_batch_input(b"\n\n", max_bytes=100, max_lines=1)
