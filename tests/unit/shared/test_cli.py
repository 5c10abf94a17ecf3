"""`cortex status` reads the fleet from Redis; `cortex up` supervises a process tree."""

import json
import signal
import sys
import time
from pathlib import Path

import fakeredis
import pytest
from rich.console import Console

from shared import cli
from shared.heartbeat import DeviceInfo, ModelInfo, NodeHeartbeat
from shared.keys import CONSUMER_GROUP, Keys
from shared.lifecycle import ModelState

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


def publish(r, keys: Keys, hb: NodeHeartbeat) -> None:
    r.hset(keys.node(hb.node), mapping=hb.to_hash())
    r.zadd(keys.nodes(), {hb.node: hb.heartbeat_ms})


@pytest.fixture
def r():
    return fakeredis.FakeRedis()


def test_empty_redis_reads_as_empty_fleet(r):
    fleet = cli.read_fleet(r, Keys(), now_ms=NOW_MS)
    assert fleet.nodes == [] and fleet.queues == []


def test_live_node_shows_devices_models_and_slots(r):
    keys = Keys()
    ready = ModelInfo(state=ModelState.READY, device="cpu", slots_total=16, slots_used=3)
    publish(r, keys, heartbeat("n1", **{MODEL: ready}))

    (node,) = cli.read_fleet(r, keys, node_ttl_s=8, now_ms=NOW_MS).nodes

    assert node.node == "n1" and node.alive and node.state == "active"
    assert node.heartbeat_age_s == pytest.approx(1.0)
    assert node.version == "0.1.0"
    assert node.devices[0].used_mb == 6_000 and node.devices[0].total_mb == 24_000
    model = node.models[MODEL]
    assert (model.state, model.slots_used, model.slots_total) == ("ready", 3, 16)


def test_stale_and_gone_nodes_are_not_alive(r):
    keys = Keys()
    publish(r, keys, heartbeat("stale", age_s=30))
    r.zadd(keys.nodes(), {"gone": NOW_MS - 120_000})  # hash expired, score left behind

    nodes = {n.node: n for n in cli.read_fleet(r, keys, node_ttl_s=8, now_ms=NOW_MS).nodes}

    assert not nodes["stale"].alive and nodes["stale"].state == "active"
    assert not nodes["gone"].alive and nodes["gone"].state == "gone"
    assert nodes["gone"].heartbeat_age_s == pytest.approx(120)


def test_unreadable_heartbeat_is_reported_not_raised(r):
    keys = Keys()
    r.hset(keys.node("odd"), mapping={"node": "odd", "devices": "not json"})
    r.zadd(keys.nodes(), {"odd": NOW_MS})

    (node,) = cli.read_fleet(r, keys, now_ms=NOW_MS).nodes

    assert node.state == "unreadable" and not node.alive and node.error


def test_queue_depth_splits_waiting_from_in_flight(r):
    keys = Keys()
    stream = keys.jobs(MODEL)
    r.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(5):
        r.xadd(stream, {"job": f"j{i}"})
    r.xreadgroup(CONSUMER_GROUP, "n1", {stream: ">"}, count=2)

    (queue,) = cli.read_fleet(r, keys, now_ms=NOW_MS).queues

    assert queue.model == MODEL
    assert (queue.length, queue.waiting, queue.in_flight, queue.consumers) == (5, 3, 2, 1)


def test_stream_without_group_counts_everything_as_waiting(r):
    keys = Keys()
    r.xadd(keys.jobs("other"), {"job": "j"})

    (queue,) = cli.read_fleet(r, keys, now_ms=NOW_MS).queues

    assert (queue.model, queue.waiting, queue.in_flight, queue.consumers) == ("other", 1, 0, 0)


def test_prefix_keeps_fleets_apart(r):
    publish(r, Keys("a:"), heartbeat("node-a"))
    publish(r, Keys("b:"), heartbeat("node-b"))

    assert [n.node for n in cli.read_fleet(r, Keys("b:"), now_ms=NOW_MS).nodes] == ["node-b"]


def test_table_names_node_model_state_and_slots(r):
    keys = Keys()
    publish(r, keys, heartbeat("n1", **{MODEL: ModelInfo(state=ModelState.LOADING, device="cpu", slots_total=16)}))
    console = Console(record=True, width=200, color_system=None)

    cli.render_fleet(cli.read_fleet(r, keys, now_ms=NOW_MS), console)

    text = console.export_text()
    for expected in ("n1", "yes", "0.1.0", "cpu Intel Xeon 5.9/23.4", MODEL, "loading", "0/16"):
        assert expected in text


def test_status_json_for_scripts(r, monkeypatch, capsys):
    publish(r, Keys(), heartbeat("n1", age_s=0))
    monkeypatch.setattr(cli.redis.Redis, "from_url", classmethod(lambda cls, url, **kw: r))

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["status", "--json"])

    assert exit_info.value.code == 0
    data = json.loads(capsys.readouterr().out)
    assert [n["node"] for n in data["nodes"]] == ["n1"]
    assert set(data["nodes"][0]) >= {"alive", "heartbeat_age_s", "version", "state", "devices", "models"}


def test_models_show_idle_time_and_queue_depth_over_all_streams(r):
    keys = Keys()
    idle = ModelInfo(state=ModelState.READY, device="cpu", slots_total=4, memory_mb=300, last_used_ms=NOW_MS - 90_000)
    busy = ModelInfo(state=ModelState.READY, device="cpu", slots_total=4, slots_used=1, last_used_ms=NOW_MS)
    publish(r, keys, heartbeat("n1", **{MODEL: idle, "busy": busy}))
    default, batch = keys.jobs(MODEL), keys.jobs(MODEL, "batch")
    for stream in (default, batch):
        r.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(3):
        r.xadd(default, {"job": f"j{i}"})
    r.xadd(batch, {"job": "b"})
    r.xreadgroup(CONSUMER_GROUP, "n1", {default: ">"}, count=1)  # read: running, not queued
    r.xadd(keys.jobs(MODEL, "interactive", "high"), {"job": "h"})  # no group yet: unread

    (node,) = cli.read_fleet(r, keys, node_ttl_s=8, now_ms=NOW_MS).nodes

    model = node.models[MODEL]
    assert model.idle_s == pytest.approx(90.0) and model.memory_mb == 300
    assert model.queue_depth == 2 + 1 + 1
    assert node.models["busy"].queue_depth == 0 and node.models["busy"].idle_s == 0


def test_catalogue_models_no_live_node_holds_are_not_loaded(r):
    keys = Keys()
    publish(r, keys, heartbeat("n1", **{MODEL: ModelInfo(state=ModelState.READY, device="cpu")}))
    publish(r, keys, heartbeat("dead", age_s=60, **{"on-dead": ModelInfo(state=ModelState.READY, device="cpu")}))
    publish(r, keys, heartbeat("n2", **{"broken": ModelInfo(state=ModelState.FAILED, device="cpu", error="oom")}))
    r.hset(keys.catalog(), mapping={
        MODEL: json.dumps({"id": MODEL, "memory_mb": 200}),
        "cold": json.dumps({"id": "cold", "memory_mb": 900, "pin": True}),
        "on-dead": json.dumps({"id": "on-dead"}),
        "broken": json.dumps({"id": "broken"}),
    })
    r.xadd(keys.jobs("cold"), {"job": "waits for placement"})

    fleet = cli.read_fleet(r, keys, node_ttl_s=8, now_ms=NOW_MS)

    not_loaded = {c.model: c for c in fleet.not_loaded}
    assert set(not_loaded) == {"cold", "on-dead", "broken"}
    assert not_loaded["cold"].state == "not loaded"
    assert (not_loaded["cold"].memory_mb, not_loaded["cold"].pin, not_loaded["cold"].queue_depth) == (900, True, 1)
    assert not_loaded["on-dead"].memory_mb is None and not not_loaded["on-dead"].pin

    console = Console(record=True, width=200, color_system=None)
    cli.render_fleet(fleet, console)
    text = console.export_text()
    assert "not loaded" in text and "cold" in text and "900" in text


def test_table_shows_idle_time_queue_depth_and_labels(r):
    keys = Keys()
    hb = heartbeat("n1", **{MODEL: ModelInfo(state=ModelState.READY, device="cpu", slots_total=4,
                                             last_used_ms=NOW_MS - 125_000)})
    hb.labels = ["gpu", "fast"]
    hb.state = "draining"
    publish(r, keys, hb)
    r.xadd(keys.jobs(MODEL), {"job": "j"})
    console = Console(record=True, width=200, color_system=None)

    cli.render_fleet(cli.read_fleet(r, keys, now_ms=NOW_MS), console)

    text = console.export_text()
    for expected in ("q=1", "idle=2m05s", "draining", "gpu,fast"):
        assert expected in text


def test_status_json_carries_idle_queue_depth_and_not_loaded(r, monkeypatch, capsys):
    keys = Keys()
    now = int(time.time() * 1000)
    hb = heartbeat("n1", **{MODEL: ModelInfo(state=ModelState.READY, device="cpu", last_used_ms=now - 10_000)})
    hb.heartbeat_ms = now
    publish(r, keys, hb)
    r.hset(keys.catalog(), mapping={MODEL: json.dumps({"id": MODEL}), "cold": json.dumps({"id": "cold"})})
    r.xadd(keys.jobs(MODEL), {"job": "j"})
    monkeypatch.setattr(cli.redis.Redis, "from_url", classmethod(lambda cls, url, **kw: r))

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["status", "--json"])

    assert exit_info.value.code == 0
    data = json.loads(capsys.readouterr().out)
    model = data["nodes"][0]["models"][MODEL]
    assert model["queue_depth"] == 1 and model["idle_s"] == pytest.approx(10, abs=5)
    assert [c["model"] for c in data["not_loaded"]] == ["cold"]
    assert data["not_loaded"][0]["state"] == "not loaded"


def test_status_says_when_redis_is_unreachable(monkeypatch, capsys):
    monkeypatch.setenv("CORTEX_REDIS_URL", "redis://127.0.0.1:1/0")

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["status"])

    assert exit_info.value.code == 2
    assert "cannot read Redis" in capsys.readouterr().err


def test_flags_override_settings_only_when_given():
    args = cli.build_parser().parse_args(["node", "--models", "a, b", "--node-name", "n7"])
    assert cli._overrides(args, models="models", node_name="node_name", device="device") == {
        "models": ["a", "b"],
        "node_name": "n7",
    }


def test_supervisor_stops_in_reverse_order_and_kills_stragglers(tmp_path: Path):
    stubborn = tmp_path / "stubborn-ready"
    ignore_term = (
        "import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(stubborn)!r}).touch(); time.sleep(60)"
    )
    sup = cli.Supervisor(stop_timeout_s=0.5)
    first = sup.start("first", [sys.executable, "-c", ignore_term])
    second = sup.start("second", ["sleep", "60"])
    deadline = time.monotonic() + 10
    while not stubborn.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sup.first_dead() is None
    stopped = []

    sup.stop_all(log=stopped.append)

    assert stopped[0].startswith("stopping second") and stopped[1].startswith("stopping first")
    assert second.proc.returncode == -signal.SIGTERM
    assert first.proc.returncode == -signal.SIGKILL


def test_supervisor_notices_a_dead_child():
    sup = cli.Supervisor(stop_timeout_s=1)
    sup.start("alive", ["sleep", "60"])
    dead = sup.start("dies", [sys.executable, "-c", "raise SystemExit(3)"])
    dead.proc.wait()
    try:
        assert sup.first_dead() is dead
    finally:
        sup.stop_all(log=lambda _: None)
    assert all(c.proc.returncode is not None for c in sup.children)
