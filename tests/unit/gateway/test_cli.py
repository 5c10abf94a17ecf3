"""The `cortex` verbs in-process against a real redis-server: `status` prints what `Fleet.status`
reads and says which Redis it read (a named one, the local stack's run file, or the default);
flags become settings."""

import json
import os
import time

import pytest
import redis

from gateway.cli import main, run_file
from shared.heartbeat import DeviceInfo, ModelInfo, NodeHeartbeat
from shared.keys import Keys
from shared.lifecycle import ModelState

MODEL = "SmolLM2-135M-Instruct"


def publish(client: redis.Redis, **models: ModelInfo) -> None:
    now = int(time.time() * 1000)
    hb = NodeHeartbeat(
        node="n1",
        version="0.1.0",
        started_ms=now,
        heartbeat_ms=now,
        models=models,
        devices=[DeviceInfo(id="cpu", name="Xeon", total_mb=24_000, free_mb=18_000)],
    )
    client.hset(Keys().node("n1"), mapping=hb.to_hash())
    client.zadd(Keys().nodes(), {"n1": now})


def status(capsys, *flags: str) -> tuple[int, dict, str]:
    with pytest.raises(SystemExit) as exit_info:
        main.main(["status", "--json", *flags])
    out = capsys.readouterr()
    return exit_info.value.code, json.loads(out.out) if out.out else {}, out.err


@pytest.fixture
def no_redis_named(monkeypatch, tmp_path):
    monkeypatch.delenv("CORTEX_REDIS_URL", raising=False)
    monkeypatch.delenv("CORTEX_CONFIG", raising=False)
    monkeypatch.setenv(run_file.RUN_FILE_ENV, str(tmp_path / "up.json"))


def test_status_json_carries_nodes_idle_queue_depth_and_not_loaded(redis_url, monkeypatch, capsys):
    client = redis.Redis.from_url(redis_url)
    publish(
        client,
        **{
            MODEL: ModelInfo(
                state=ModelState.READY,
                device="cpu",
                max_model_len=8192,
                last_used_ms=int(time.time() * 1000) - 10_000,
            )
        },
    )
    client.hset(
        Keys().catalog(),
        mapping={MODEL: json.dumps({"id": MODEL}), "cold": json.dumps({"id": "cold"})},
    )
    client.xadd(Keys().jobs(MODEL), {"job": "j"})
    monkeypatch.setenv("CORTEX_REDIS_URL", redis_url)

    code, data, err = status(capsys)

    assert code == 0 and "from CORTEX_REDIS_URL" in err
    (node,) = data["nodes"]
    assert node["node"] == "n1" and node["alive"] and node["state"] == "active"
    model = node["models"][MODEL]
    assert model["queue_depth"] == 1 and model["idle_s"] == pytest.approx(10, abs=5)
    assert model["max_model_len"] == 8192
    assert [c["model"] for c in data["not_loaded"]] == ["cold"]


def test_without_a_named_redis_status_reads_the_local_stack(redis_url, no_redis_named, capsys):
    publish(redis.Redis.from_url(redis_url))
    run_file.RunFile(pid=os.getpid(), redis_url=redis_url, gateway_url="http://127.0.0.1:1").write()

    code, data, err = status(capsys)

    assert code == 0 and [n["node"] for n in data["nodes"]] == ["n1"]
    assert redis_url in err and "`cortex up`" in err


def test_a_run_file_left_by_a_dead_cortex_up_is_ignored(no_redis_named, capsys):
    run_file.RunFile(
        pid=2**22 + 1, redis_url="redis://127.0.0.1:1/0", gateway_url=""
    ).write()  # no such pid

    assert run_file.read() is None
    code, _, err = status(capsys, "--redis-url", "redis://127.0.0.1:1/0")
    assert code == 2 and "cannot read Redis at redis://127.0.0.1:1/0" in err


def test_flags_override_settings_only_when_given():
    args = main.build_parser().parse_args(["node", "--models", "a, b", "--node-name", "n7"])
    assert main._overrides(args, models="models", node_name="node_name", device="device") == {
        "models": ["a", "b"],
        "node_name": "n7",
    }
