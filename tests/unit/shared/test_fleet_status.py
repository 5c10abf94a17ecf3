"""`Fleet.status`: what `cortex status` shows, read from Redis (fakeredis, its Lua through lupa)."""

import json

import fakeredis
import pytest
from rich.console import Console

from gateway.cli.status import render_fleet
from shared.fleet import Fleet
from shared.fleet_status import FleetStatus
from shared.heartbeat import DeviceInfo, KVCacheStats, ModelInfo, NodeHeartbeat, SpecDecodeStats
from shared.keys import CONSUMER_GROUP, Keys
from shared.lifecycle import ModelState
from shared.redis_health import RedisHealth

NOW_MS = 1_800_000_000_000
MODEL = "SmolLM2-135M-Instruct"


def heartbeat(node: str, age_s: float = 1.0, **models: ModelInfo) -> NodeHeartbeat:
    return NodeHeartbeat(
        node=node,
        version="0.1.0",
        started_ms=NOW_MS - 60_000,
        heartbeat_ms=int(NOW_MS - age_s * 1000),
        devices=[DeviceInfo(id="cpu", name="Intel Xeon", total_mb=24_000, free_mb=18_000)],
        models=models,
    )


async def publish(r, keys: Keys, hb: NodeHeartbeat) -> None:
    await r.hset(keys.node(hb.node), mapping=hb.to_hash())
    await r.zadd(keys.nodes(), {hb.node: hb.heartbeat_ms})


@pytest.fixture
def r():
    return fakeredis.FakeAsyncRedis()


async def test_empty_redis_reads_as_empty_fleet(r):
    fleet = await Fleet(r, Keys(), 8).status(NOW_MS)
    assert fleet.nodes == [] and fleet.queues == []


async def test_live_node_shows_devices_models_and_slots(r):
    keys = Keys()
    ready = ModelInfo(state=ModelState.READY, device="cpu", slots_total=16, slots_used=3)
    await publish(r, keys, heartbeat("n1", **{MODEL: ready}))

    (node,) = (await Fleet(r, keys, 8).status(NOW_MS)).nodes

    assert node.node == "n1" and node.alive and node.state == "active"
    assert node.heartbeat_age_s == pytest.approx(1.0)
    assert node.version == "0.1.0"
    assert node.devices[0].used_mb == 6_000 and node.devices[0].total_mb == 24_000
    model = node.models[MODEL]
    assert (model.state, model.slots_used, model.slots_total) == ("ready", 3, 16)


async def test_stale_and_gone_nodes_are_not_alive(r):
    keys = Keys()
    await publish(r, keys, heartbeat("stale", age_s=30))
    await r.zadd(keys.nodes(), {"gone": NOW_MS - 120_000})  # hash expired, score left behind

    nodes = {n.node: n for n in (await Fleet(r, keys, 8).status(NOW_MS)).nodes}

    assert not nodes["stale"].alive and nodes["stale"].state == "active"
    assert not nodes["gone"].alive and nodes["gone"].state == "gone"
    assert nodes["gone"].heartbeat_age_s == pytest.approx(120)


async def test_unreadable_heartbeat_is_reported_not_raised(r):
    keys = Keys()
    await r.hset(keys.node("odd"), mapping={"node": "odd", "devices": "not json"})
    await r.zadd(keys.nodes(), {"odd": NOW_MS})

    (node,) = (await Fleet(r, keys, 8).status(NOW_MS)).nodes

    assert node.state == "unreadable" and not node.alive and node.error


async def test_queue_depth_splits_waiting_from_in_flight(r):
    keys = Keys()
    stream = keys.jobs(MODEL)
    await r.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(5):
        await r.xadd(stream, {"job": f"j{i}"})
    await r.xreadgroup(CONSUMER_GROUP, "n1", {stream: ">"}, count=2)

    (queue,) = (await Fleet(r, keys, 8).status(NOW_MS)).queues

    assert queue.model == MODEL
    assert (queue.queued["interactive"], queue.running, queue.replicas) == (3, 2, 0)


async def test_replicas_count_the_live_nodes_whatever_their_heartbeat_order(r):
    keys = Keys()
    ready = ModelInfo(state=ModelState.READY, device="cpu", slots_total=4)
    await publish(r, keys, heartbeat("a-live", age_s=1, **{MODEL: ready}))
    await publish(
        r, keys, heartbeat("b-dead", age_s=30, other=ready)
    )  # Redis lists it first: older

    fleet = await Fleet(r, keys, 8).status(NOW_MS)

    assert [(n.node, n.alive) for n in fleet.nodes] == [("a-live", True), ("b-dead", False)]
    assert {q.model: q.replicas for q in fleet.queues} == {MODEL: 1, "other": 0}


async def test_stream_without_group_counts_everything_as_waiting(r):
    keys = Keys()
    await r.xadd(keys.jobs("other"), {"job": "j"})

    (queue,) = (await Fleet(r, keys, 8).status(NOW_MS)).queues

    assert (queue.model, queue.queued["interactive"], queue.running) == ("other", 1, 0)


async def test_prefix_keeps_fleets_apart(r):
    await publish(r, Keys("a:"), heartbeat("node-a"))
    await publish(r, Keys("b:"), heartbeat("node-b"))

    assert [n.node for n in (await Fleet(r, Keys("b:"), 8).status(NOW_MS)).nodes] == ["node-b"]


async def test_table_names_node_model_state_and_slots(r):
    keys = Keys()
    await publish(
        r,
        keys,
        heartbeat(
            "n1", **{MODEL: ModelInfo(state=ModelState.LOADING, device="cpu", slots_total=16)}
        ),
    )
    console = Console(record=True, width=200, color_system=None)

    render_fleet(await Fleet(r, keys, 8).status(NOW_MS), console)

    text = console.export_text()
    for expected in ("n1", "yes", "0.1.0", "cpu Intel Xeon 5.9/23.4", MODEL, "loading", "0/16"):
        assert expected in text


async def test_models_show_idle_time_and_queue_depth_over_all_streams(r):
    keys = Keys()
    idle = ModelInfo(
        state=ModelState.READY,
        device="cpu",
        slots_total=4,
        memory_mb=300,
        last_used_ms=NOW_MS - 90_000,
    )
    busy = ModelInfo(
        state=ModelState.READY, device="cpu", slots_total=4, slots_used=1, last_used_ms=NOW_MS
    )
    await publish(r, keys, heartbeat("n1", **{MODEL: idle, "busy": busy}))
    default, batch = keys.jobs(MODEL), keys.jobs(MODEL, "batch")
    for stream in (default, batch):
        await r.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(3):
        await r.xadd(default, {"job": f"j{i}"})
    await r.xadd(batch, {"job": "b"})
    await r.xreadgroup(CONSUMER_GROUP, "n1", {default: ">"}, count=1)  # read: running, not queued
    await r.xadd(keys.jobs(MODEL, "interactive", "high"), {"job": "h"})  # no group yet: unread

    (node,) = (await Fleet(r, keys, 8).status(NOW_MS)).nodes

    model = node.models[MODEL]
    assert model.idle_s == pytest.approx(90.0) and model.memory_mb == 300
    assert model.queue_depth == 2 + 1 + 1
    assert node.models["busy"].queue_depth == 0 and node.models["busy"].idle_s == 0


async def test_catalogue_models_no_live_node_holds_are_not_loaded(r):
    keys = Keys()
    await publish(
        r, keys, heartbeat("n1", **{MODEL: ModelInfo(state=ModelState.READY, device="cpu")})
    )
    await publish(
        r,
        keys,
        heartbeat("dead", age_s=60, **{"on-dead": ModelInfo(state=ModelState.READY, device="cpu")}),
    )
    await publish(
        r,
        keys,
        heartbeat(
            "n2", **{"broken": ModelInfo(state=ModelState.FAILED, device="cpu", error="oom")}
        ),
    )
    await r.hset(
        keys.catalog(),
        mapping={
            MODEL: json.dumps({"id": MODEL, "memory_mb": 200}),
            "cold": json.dumps({"id": "cold", "memory_mb": 900, "pin": True}),
            "on-dead": json.dumps({"id": "on-dead"}),
            "broken": json.dumps({"id": "broken"}),
        },
    )
    await r.xadd(keys.jobs("cold"), {"job": "waits for placement"})

    fleet = await Fleet(r, keys, 8).status(NOW_MS)

    not_loaded = {c.model: c for c in fleet.not_loaded}
    assert set(not_loaded) == {"cold", "on-dead", "broken"}
    assert not_loaded["cold"].state == "not loaded"
    assert (
        not_loaded["cold"].memory_mb,
        not_loaded["cold"].pin,
        not_loaded["cold"].queue_depth,
    ) == (900, True, 1)
    assert not_loaded["on-dead"].memory_mb is None and not not_loaded["on-dead"].pin

    console = Console(record=True, width=200, color_system=None)
    render_fleet(fleet, console)
    text = console.export_text()
    assert "not loaded" in text and "cold" in text and "900" in text


async def test_table_shows_idle_time_queue_depth_weights_and_labels(r):
    keys = Keys()
    hb = heartbeat(
        "n1",
        **{
            MODEL: ModelInfo(
                state=ModelState.READY,
                device="cpu",
                slots_total=4,
                max_model_len=8192,
                last_used_ms=NOW_MS - 125_000,
                quant="int4",
                weight_mb=171,
                kernels="float32: oneDNN over packed weights; decode step: compiled",
            )
        },
    )
    hb.labels = ["gpu", "fast"]
    hb.state = "draining"
    await publish(r, keys, hb)
    await r.xadd(keys.jobs(MODEL), {"job": "j"})
    console = Console(record=True, width=200, color_system=None)

    render_fleet(await Fleet(r, keys, 8).status(NOW_MS), console)

    text = console.export_text()
    for expected in (
        "ctx=8192",
        "weights=int4:171MB",
        "q=1",
        "idle=2m05s",
        "draining",
        "gpu,fast",
        "float32: oneDNN over packed weights; decode step: compiled",
    ):
        assert expected in text


async def test_a_tensor_parallel_model_is_one_replica_spanning_its_devices(r):
    keys = Keys()
    sharded = ModelInfo(
        state=ModelState.READY, device="cpu:0", devices=["cpu:0", "cpu:1"], slots_total=4
    )
    hb = heartbeat("n1", **{MODEL: sharded})
    hb.devices = [
        DeviceInfo(id=f"cpu:{i}", name="Intel Xeon", total_mb=500, free_mb=400) for i in range(2)
    ]
    await publish(r, keys, hb)
    await r.xgroup_create(keys.jobs(MODEL), CONSUMER_GROUP, id="0", mkstream=True)

    fleet = await Fleet(r, keys, 8).status(NOW_MS)

    assert fleet.nodes[0].models[MODEL].devices == ["cpu:0", "cpu:1"]
    assert [q.replicas for q in fleet.queues if q.model == MODEL] == [1]
    console = Console(width=200, record=True)
    render_fleet(fleet, console)
    assert "tp=2 on cpu:0+cpu:1" in console.export_text()


async def test_models_show_their_kv_cache_prefix_hit_rate_and_speculation(r):
    keys = Keys()
    warm = KVCacheStats(
        block_size=16,
        blocks_total=400,
        blocks_used=148,
        blocks_cached=52,
        prefix_queries=1000,
        prefix_hits=819,
        preemptions=2,
    )
    cold = KVCacheStats(block_size=16, blocks_total=100, blocks_used=29)
    await publish(
        r,
        keys,
        heartbeat(
            "n1",
            **{
                MODEL: ModelInfo(
                    state=ModelState.READY,
                    device="cpu",
                    slots_total=16,
                    slots_used=3,
                    kv=warm,
                    spec=SpecDecodeStats(drafts=50, draft_tokens=300, accepted_tokens=227),
                ),
                "cold": ModelInfo(
                    state=ModelState.READY,
                    device="cpu",
                    slots_total=4,
                    slots_used=1,
                    kv=cold,
                    spec=SpecDecodeStats(),
                ),  # speculation off, or nothing drafted yet
                "loading": ModelInfo(state=ModelState.LOADING, device="cpu", slots_total=4),
                "tiered": ModelInfo(
                    state=ModelState.READY,
                    device="cpu",
                    slots_total=4,
                    kv=KVCacheStats(
                        block_size=16,
                        blocks_total=100,
                        blocks_used=10,
                        prefix_queries=1000,
                        prefix_hits=500,
                        host_blocks_total=300,
                        host_blocks_used=40,
                        host_hits=300,
                        disk_blocks=900,
                        disk_hits=100,
                    ),
                ),
            },
        ),
    )

    fleet = await Fleet(r, keys, 8).status(NOW_MS)

    models = fleet.nodes[0].models
    assert models[MODEL].kv == warm and models["loading"].kv is None
    assert (
        json.loads(fleet.model_dump_json())["nodes"][0]["models"][MODEL]["kv"]["prefix_hits"] == 819
    )
    console = Console(record=True, width=260, color_system=None)
    render_fleet(fleet, console)
    nodes_table = console.export_text().split("Queues")[0]
    rows = [line.split("│")[7:9] for line in nodes_table.splitlines() if line.count("│") == 9]
    kv_by_model = {
        model.split()[0]: kv.strip() for model, kv in rows
    }  # a row per model, its KV cache beside it
    assert kv_by_model == {
        MODEL: "KV 37% (148/400 blk) prefix 81% spec 75%",  # floored, not rounded
        "cold": "KV 29% (29/100 blk) prefix -",  # no prompt looked up yet
        "loading": "",  # no engine yet
        "tiered": "KV 10% (10/100 blk) prefix 50% host 40/300 blk (60% of hits) disk 900 blk (20%"
        " of hits)",  # the tiers below the device
    }


def test_status_shows_how_redis_keeps_its_data_and_its_warnings():
    redis = RedisHealth(
        version="7.0.15",
        aof=False,
        appendfsync="everysec",
        snapshots="",
        eviction_policy="allkeys-lru",
        used_memory_mb=900.0,
        maxmemory_mb=1024.0,
        warnings=["Redis may evict keys when full"],
    )
    console = Console(record=True, width=200, color_system=None)

    render_fleet(FleetStatus(now_ms=NOW_MS, nodes=[], queues=[], redis=redis), console)

    text = console.export_text()
    assert (
        "Redis 7.0.15: 900.0 MB used of 1024 MB maxmemory; persistence: none; eviction: allkeys-lru"
        in text
    )
    assert "warning: Redis may evict keys when full" in text
