"""Fair shares between callers on a real redis-server: the gateway's enqueue (SUBMIT_LUA), the
node's reader taking the waiting rooms round-robin, positions, withdrawal, queue depth and
shedding by queue depth (shared/queues.py, gateway/jobs/queue.py, node_agent/serving/job_reader.py)."""

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.bus.queued_jobs import entry_waiting
from gateway.jobs import queue
from node_agent.serving import job_reader
from node_agent.serving.job_reader import JobReader
from shared import queues
from shared.errors import QueueFull
from shared.keys import CONSUMER_GROUP, Keys

KEYS = Keys()
M = "m"
SHARED = KEYS.jobs(M)


@pytest.fixture
async def r(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def reader(r) -> JobReader:
    reader = JobReader(r, KEYS, M, "n1", batch_max_wait_s=60)
    await reader.ensure_groups()
    return reader


async def enqueue(r, tenant: str, job: str, stream: str = SHARED, max_waiting: int = 0):
    fields = {"job": job, "channel": f"events:{job}"}
    return await queue.enqueue(
        r, KEYS, stream, fields, tenant=tenant, max_waiting=max_waiting, maxlen=1000
    )


async def read_all(reader: JobReader, free: int = 1) -> list[str]:
    """Every job the node reads, `free` at a time, acknowledged as a node does when each ends."""
    order = []
    while got := await reader._read_streams(free, free):
        for entry in got:
            order.append(entry.fields[b"job"].decode())
            await reader.settle([(entry.stream, entry.entry_id)])
    return order


async def leftovers(r) -> list[bytes]:
    return [k async for k in r.scan_iter(match=KEYS.all_waiting())]


async def test_a_flood_from_one_key_does_not_starve_another(r, reader):
    for i in range(200):
        await enqueue(r, "flood", f"a{i}")
    await enqueue(r, "bystander", "b")
    order = await read_all(reader)
    assert len(order) == 201
    assert order.index("b") <= 2  # after the one already on the shared stream and one in turn
    assert order[:2] == ["a0", "a1"] and order[3:6] == ["a2", "a3", "a4"]  # then the flood
    assert await leftovers(r) == [] and await r.xlen(SHARED) == 0


async def test_a_full_replica_takes_a_caller_with_nothing_running_here_beyond_its_slots(r, reader):
    """While rooms hold jobs, a replica takes up to `newcomers` jobs beyond its free slots, each a
    job of a caller with nothing running on it, from its room, however the ring is ordered (marked
    `newcomer`: the engine makes it a row); with nothing to take there, a full replica's read comes
    back at once (`full`) instead of blocking on the streams."""
    for i in range(20):
        await enqueue(r, "flood", f"a{i}")
    first = await reader._read_streams(1, 1)  # the shared stream's
    assert [e.fields[b"job"] for e in first] == [b"a0"]
    await reader.settle([(e.stream, e.entry_id) for e in first])
    await enqueue(r, "bystander", "b")
    await enqueue(r, "other", "c")
    taken = await reader._read_streams(0, 0, 1, {"flood", "bystander"})  # full
    assert [(e.fields[b"job"], e.newcomer) for e in taken] == [(b"c", True)] and reader.full
    await reader.settle([(e.stream, e.entry_id) for e in taken])
    got = await reader._read_streams(1, 1, 1, {"flood"})  # a slot free, and a newcomer's
    assert [(e.fields[b"job"], e.newcomer) for e in got] == [(b"a1", False), (b"b", True)]
    await reader.settle([(e.stream, e.entry_id) for e in got])
    assert await reader._read_streams(0, 0, 1, {"flood"}) == [] and reader.full
    assert await read_all(reader) == [f"a{i}" for i in range(2, 20)]
    assert await leftovers(r) == [] and await r.xlen(SHARED) == 0


async def test_without_waiting_rooms_nothing_is_taken_beyond_the_slots(r, reader):
    await enqueue(r, "solo", "s0")  # straight to the shared stream: nothing waits
    assert await reader._read_streams(0, 0, 1, set()) == [] and reader.full
    got = await reader._read_streams(1, 1, 1, set())
    assert [(e.fields[b"job"], e.newcomer) for e in got] == [(b"s0", False)]


async def test_a_job_for_a_nodes_own_stream_waits_in_its_room_while_rooms_hold_jobs(r, reader):
    """Cache-aware routing sends a job to a node's own stream; while the band's rooms hold jobs (every
    replica full) it waits in its caller's room instead, where any replica's newcomers' slot takes it."""
    own = KEYS.node_jobs(M, "n1")
    assert (await enqueue(r, "solo", "s0", stream=own))[0] == own  # nothing waits
    for i in range(3):
        await enqueue(r, "flood", f"a{i}")  # a0 to the shared stream, the rest to the flood's room
    where, _ = await enqueue(r, "bystander", "b", stream=own)
    assert where == KEYS.waiting_room(M, "bystander")
    first = await reader._read_streams(2, 2)  # its own stream's, then the shared stream's
    assert [e.fields[b"job"] for e in first] == [b"s0", b"a0"]
    got = await reader._read_streams(0, 0, 1, {"solo", "flood"})
    assert [(e.fields[b"job"], e.newcomer) for e in got] == [(b"b", True)]


async def test_a_room_made_for_a_job_is_announced_to_the_nodes(r, reader):
    """Each room made (a caller's first job waiting) is announced on the model's `Keys.newcomers`
    with its name: the flood's room once, the bystander's once; a job joining a room, never."""
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(KEYS.newcomers(M))
    for i in range(5):
        await enqueue(r, "flood", f"a{i}")
    await enqueue(r, "bystander", "b0")
    await enqueue(r, "bystander", "b1")
    heard, deadline = [], asyncio.get_running_loop().time() + 1
    while asyncio.get_running_loop().time() < deadline:  # (None also for a subscription's reply)
        if (message := await pubsub.get_message(timeout=0.1)) is not None:
            heard.append((message["channel"], message["data"]))
    assert heard == [(KEYS.newcomers(M).encode(), M.encode())] * 2
    await pubsub.aclose()


async def test_a_room_still_holding_jobs_after_a_newcomer_was_taken_is_announced_again(r, reader):
    """A full replica that took a newcomer's job from a room that holds more announces the room
    again: another replica, where that caller runs nothing, takes the next at once."""
    for i in range(3):
        await enqueue(r, "flood", f"a{i}")
    await reader.settle([(e.stream, e.entry_id) for e in await reader._read_streams(1, 1)])
    await enqueue(r, "bystander", "b0")
    await enqueue(r, "bystander", "b1")  # (its room held b0: not announced)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(KEYS.newcomers(M))
    taken = await reader._read_streams(0, 0, 1, {"flood"})
    assert [(e.fields[b"job"], e.newcomer) for e in taken] == [(b"b0", True)]
    for _ in range(5):  # (None also for the subscription's reply)
        if (message := await pubsub.get_message(timeout=0.5)) is not None:
            break
    assert message is not None and (message["channel"], message["data"]) == (
        KEYS.newcomers(M).encode(),
        M.encode(),
    )
    await pubsub.aclose()


async def test_keys_take_turns_one_job_each(r, reader):
    for tenant in ("x", "y", "z"):
        for i in range(3):
            await enqueue(r, tenant, f"{tenant}{i}")
    # x0 went straight to the shared stream (nothing waited); the rest wait in three rooms
    assert await read_all(reader, free=4) == [
        *["x0", "x1", "y0", "z0"],
        *["x2", "y1", "z1", "y2"],
        "z2",
    ]


async def test_an_idle_queue_takes_a_job_straight_to_the_shared_stream(r, reader):
    where, entry_id = await enqueue(r, "k", "first")
    assert where == SHARED and await r.xlen(SHARED) == 1
    where, _ = await enqueue(r, "k", "second")  # the first is unread: it waits in its room
    assert where == KEYS.waiting_room(M, "k")
    assert await r.lrange(KEYS.waiting_keys(M), 0, -1) == [where.encode()]
    got = await reader.read(free=2, batch_free=0)
    assert [e.stream for e in got] == [SHARED, SHARED]  # read where every node acknowledges
    assert [e.fields[b"job"] for e in got] == [b"first", b"second"]
    assert (await r.xpending(SHARED, CONSUMER_GROUP))["pending"] == 2
    assert await leftovers(r) == []  # an emptied room and an emptied list are gone


async def test_a_routed_job_never_waits_in_a_room(r, reader):
    await enqueue(r, "k", "shared")
    own = KEYS.node_jobs(M, "n1")
    where, _ = await enqueue(r, "k", "routed", stream=own)
    assert where == own and await leftovers(r) == []


async def test_positions_follow_the_turns_and_a_withdrawn_job_leaves_nothing(r, reader):
    placed = [await enqueue(r, "a", f"a{i}") for i in range(5)]  # a0 shared, a1-a4 in a room
    b1 = await enqueue(r, "b", "b1")
    b2 = await enqueue(r, "b", "b2")
    # the node will read a0, a1, b1, a2, b2: b2 is fifth, a4 after b2
    assert await queue.position(r, KEYS, *b1) == 3
    assert await queue.position(r, KEYS, *b2) == 5
    assert await queue.position(r, KEYS, *placed[0]) == 1
    assert await queue.withdraw(r, KEYS, *b1) and await queue.withdraw(r, KEYS, *b2)
    assert not await r.exists(KEYS.waiting_room(M, "b"))
    assert await r.lrange(KEYS.waiting_keys(M), 0, -1) == [KEYS.waiting_room(M, "a").encode()]
    assert await queue.position(r, KEYS, *b2) == 0 and not await queue.withdraw(r, KEYS, *b2)
    assert await read_all(reader) == [f"a{i}" for i in range(5)]
    assert await queue.position(r, KEYS, *placed[3]) == 0  # read: no place, nothing to withdraw
    assert await leftovers(r) == []


async def test_queue_depth_counts_the_waiting_rooms(r, reader):
    for i in range(4):
        await enqueue(r, "a", f"a{i}")
    await enqueue(r, "b", "b0")
    depth = await queues.depth(r, KEYS, M)
    assert depth["queued"] == {"interactive": 5, "batch": 0} and depth["running"] == 0
    assert depth["oldest_wait_s"] is not None
    await reader.read(free=2, batch_free=0)
    depth = await queues.depth(r, KEYS, M)
    assert depth["queued"]["interactive"] == 3 and depth["running"] == 2


async def commands(r, *names: str) -> int:
    stats = await r.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in names)


async def test_queue_depth_costs_one_command_per_empty_stream(r, reader):
    """The metrics refresh reads every model's queues, with the own streams of every node holding
    it: an empty one (most of them) costs one XLEN, not a TYPE and an XPENDING besides."""
    await enqueue(r, "a", "a0")
    nodes = tuple(f"n{i}" for i in range(100))
    before = await commands(r, "xlen", "type", "xpending", "xrange", "lrange")
    depth = await queues.depth(r, KEYS, M, nodes=nodes)
    spent = await commands(r, "xlen", "type", "xpending", "xrange", "lrange") - before
    assert depth["queued"]["interactive"] == 1
    streams = len(queues.streams(KEYS, M, nodes=nodes))  # 18 + 6 a node
    assert spent <= streams + len(queues.rings(KEYS, M)) + 2  # + the one entry's XPENDING, XRANGE


async def test_counting_what_waits_skips_empty_streams(r, reader):
    """Every submit counts what waits for its class (`queue_max_waiting`): an empty stream costs
    that count one XLEN, no XPENDING."""
    before = await commands(r, "xpending")
    await enqueue(r, "a", "a0", max_waiting=10)
    assert await commands(r, "xpending") == before  # nothing waited anywhere
    await enqueue(r, "a", "a1", max_waiting=10)
    assert await commands(r, "xpending") == before + 2  # the shared stream holds a0: counted


async def test_more_than_the_limit_waiting_is_refused_and_writes_nothing(r, reader):
    for i in range(4):  # 0, 1, 2 then 3 waiting before each: all taken
        await enqueue(r, "a", f"a{i}", max_waiting=3)
    before = (await r.xlen(SHARED), await r.xlen(KEYS.waiting_room(M, "a")))
    with pytest.raises(QueueFull, match="4 interactive requests are waiting") as refused:
        await enqueue(r, "b", "b", max_waiting=3)
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "5"}
    assert (await r.xlen(SHARED), await r.xlen(KEYS.waiting_room(M, "a"))) == before
    assert not await r.exists(KEYS.waiting_room(M, "b"))
    batch = KEYS.jobs(M, "batch")  # another class's jobs do not count against interactive ones
    assert (await enqueue(r, "b", "x", stream=batch, max_waiting=3))[0] == batch


async def test_after_redis_restarts_a_job_taken_from_its_room_is_found_on_the_shared_stream(
    r, reader
):
    """The gateway's check of a queued job's entry once its events are listened to again
    (gateway/bus/queued_jobs.py): in its room it waits on; taken onto the shared stream by a node
    since, it waits on only if that was after the gateway listened again."""
    await enqueue(r, "a", "a0")
    room, entry_id = await enqueue(r, "a", "a1")
    channel = b"events:a1"
    assert await entry_waiting(r, room, entry_id, float("inf"), channel)
    await reader.read(free=2, batch_free=0)  # a0, then a1 from its room
    assert not await r.exists(room)
    assert await entry_waiting(r, room, entry_id, 60_000, channel)  # read within the last minute
    assert not await entry_waiting(r, room, entry_id, 0, channel)  # read before we listened
    assert not await entry_waiting(r, room, entry_id, 60_000, b"events:other")


async def script_runs(r) -> int:
    return await commands(r, "evalsha", "eval")


async def test_an_idle_reader_blocks_again_without_the_read_script(r, reader, monkeypatch):
    """An idle replica costs Redis one blocking XREADGROUP a round, not the read script's ~30
    commands: nothing the script reads can change while the reader is blocked on every stream.
    It still runs the script every SCRIPT_EVERY_S, and at once after its block was answered."""
    monkeypatch.setattr(job_reader, "BLOCK_MS", 50)
    monkeypatch.setattr(job_reader, "SCRIPT_EVERY_S", 3600)
    assert await reader.read(free=2, batch_free=2) == []  # the script, then a block that runs out
    before = await script_runs(r)
    for _ in range(3):
        assert await reader.read(free=2, batch_free=2) == []
    assert await script_runs(r) == before
    await enqueue(r, "a", "a0")  # to the shared stream, which a blocked read would take at once
    await enqueue(r, "a", "a1")  # to a's room: a0 is unread
    before = await script_runs(r)
    assert [e.fields[b"job"] for e in await reader.read(free=1, batch_free=1)] == [b"a0"]
    assert await script_runs(r) == before
    assert [e.fields[b"job"] for e in await reader.read(free=1, batch_free=1)] == [b"a1"]
    assert await script_runs(r) == before + 1


async def test_an_idle_reader_still_runs_the_script_every_so_often(r, reader, monkeypatch):
    """A job in a waiting room that no blocked read hears of (a Redis restored from its file with
    rooms in it) is taken within SCRIPT_EVERY_S."""
    monkeypatch.setattr(job_reader, "BLOCK_MS", 50)
    monkeypatch.setattr(job_reader, "SCRIPT_EVERY_S", 0.3)
    assert await reader.read(free=1, batch_free=1) == []
    room = KEYS.waiting_room(M, "a")
    await r.xadd(room, {"job": "restored", "channel": "events:restored"})
    await r.rpush(KEYS.waiting_keys(M), room)
    assert await reader.read(free=1, batch_free=1) == []  # blocked again, the room unseen
    got = []
    for _ in range(20):
        if got := await reader.read(free=1, batch_free=1):
            break
    assert [e.fields[b"job"] for e in got] == [b"restored"]


async def test_a_stream_deleted_under_a_blocked_read_is_made_again(r, reader, monkeypatch):
    """The janitor deletes the own streams of a node it thought gone; a read blocked on them is
    answered UNBLOCKED: the reader makes its streams again and reads on, the job that follows
    reaches it, and nothing fails."""
    monkeypatch.setattr(job_reader, "BLOCK_MS", 2000)
    own = KEYS.node_jobs(M, "n1")
    assert await reader.read(free=1, batch_free=1) == []  # idle: the next read blocks at once
    blocked = asyncio.ensure_future(reader.read(free=1, batch_free=1))
    await asyncio.sleep(0.2)
    await r.delete(own)
    assert await blocked == []
    assert await r.exists(own)  # made again, with its group
    await enqueue(r, "a", "routed", stream=own)
    assert [e.fields[b"job"] for e in await reader.read(free=1, batch_free=1)] == [b"routed"]
