"""What the dashboard costs a gateway watching a big fleet (issue 24): one `GET /dashboard/data` (the fleet
as `cortex status` reads it, plus the gateway's own series), against a real redis-server and a real
`python -m gateway` on free ports. The fleet is written into Redis as nodes write it: NODES heartbeats,
refreshed every second, each node serving PER_NODE of MODELS catalogue models with their KV figures,
and jobs queued (some read, some waiting) on a fifth of the models.

    .venv/bin/python scripts/bench_dashboard.py                       # 100 nodes, 100 models, 3 a node
    .venv/bin/python scripts/bench_dashboard.py --nodes 10 --models 10 --calls 50

Prints the call's latency (p50, p95), the size of its JSON, and the gateway's CPU time per call (its
/proc CPU time over the calls less the same time idle), so what one open page costs: it polls once
every 2 s. Never asserts on timings."""

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared import processes  # noqa: E402
from shared.heartbeat import DeviceInfo, KVCacheStats, ModelInfo, NodeHeartbeat  # noqa: E402
from shared.keys import CONSUMER_GROUP, Keys  # noqa: E402
from shared.lifecycle import ModelState  # noqa: E402

KEYS = Keys()
POLL_S = 2.0  # how often the page asks


def catalogue(models: int) -> str:
    return "".join(
        f'[[models]]\nid = "model-{i:03d}"\nsource = "hf:bench/model-{i:03d}"\nmemory_mb = 4000\n\n'
        for i in range(models)
    )


def heartbeat(node: int, models: int, per_node: int, now_ms: int) -> NodeHeartbeat:
    served = {
        f"model-{(node * per_node + j) % models:03d}": ModelInfo(
            state=ModelState.READY,
            device="cuda:0",
            slots_total=64,
            slots_used=(node + j) % 64,
            memory_mb=4000,
            max_model_len=8192,
            last_used_ms=now_ms,
            kv=KVCacheStats(
                block_size=16,
                blocks_total=4096,
                blocks_used=node * 7 % 4096,
                blocks_cached=100,
                prefix_queries=10_000 + node,
                prefix_hits=6_000,
            ),
        )
        for j in range(per_node)
    }
    return NodeHeartbeat(
        node=f"node-{node:03d}",
        version="bench",
        started_ms=now_ms - 3_600_000,
        heartbeat_ms=now_ms,
        devices=[
            DeviceInfo(id="cuda:0", name="H100", total_mb=81_559, free_mb=81_559 - 4000 * per_node)
        ],
        models=served,
    )


def beat_forever(client: redis.Redis, args, stop: threading.Event) -> None:
    while not stop.is_set():
        now_ms = int(time.time() * 1000)
        with client.pipeline(transaction=False) as pipe:
            for n in range(args.nodes):
                hb = heartbeat(n, args.models, args.per_node, now_ms)
                pipe.hset(KEYS.node(hb.node), mapping=hb.to_hash())
                pipe.zadd(KEYS.nodes(), {hb.node: now_ms})
            pipe.execute()
        stop.wait(1.0)


def queue_jobs(client: redis.Redis, models: int) -> None:
    """Jobs on every fifth model: 10 each, 4 of them read by a node (running), 6 waiting."""
    for i in range(0, models, 5):
        stream = KEYS.jobs(f"model-{i:03d}")
        client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
        for j in range(10):
            client.xadd(stream, {"job": f"j{i}-{j}", "submitted_ms": str(int(time.time() * 1000))})
        client.xreadgroup(CONSUMER_GROUP, "node-000", {stream: ">"}, count=4)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--per-node", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    port, gateway_port = processes.free_port(), processes.free_port()
    redis_url = f"redis://127.0.0.1:{port}/0"
    server = processes.start(
        "redis-server", processes.redis_server_argv(port, workdir=work), log_path=work / "redis.log"
    )
    stop = threading.Event()
    gateway = None
    try:
        if not processes.wait_for_redis(redis_url, server):
            sys.exit("redis-server did not start")
        client = redis.Redis.from_url(redis_url)
        (work / "models.toml").write_text(catalogue(args.models))
        queue_jobs(client, args.models)
        beating = threading.Thread(target=beat_forever, args=(client, args, stop), daemon=True)
        beating.start()
        env = os.environ | {
            "CORTEX_REDIS_URL": redis_url,
            "CORTEX_PORT": str(gateway_port),
            "CORTEX_MODELS_FILE": str(work / "models.toml"),
            "CORTEX_LOG_LEVEL": "WARNING",
            "PYTHONPATH": str(ROOT),
        }
        gateway = processes.start(
            "gateway", [sys.executable, "-m", "gateway"], env, log_path=work / "gateway.log"
        )
        url = f"http://127.0.0.1:{gateway_port}/dashboard/data"
        with httpx.Client(timeout=30) as http:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if len(http.get(url).json()["fleet"]["nodes"]) == args.nodes:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            else:
                sys.exit(f"the gateway did not come up; its log:\n{gateway.log_tail()}")
            for _ in range(5):  # warm
                http.get(url)
            latencies, size = [], 0
            cpu_before, wall_before = cpu_s(gateway.proc.pid), time.monotonic()
            for _ in range(args.calls):
                started = time.perf_counter()
                body = http.get(url).content
                latencies.append(time.perf_counter() - started)
                size = len(body)
            busy_cpu, busy_wall = (
                cpu_s(gateway.proc.pid) - cpu_before,
                time.monotonic() - wall_before,
            )
            cpu_before = cpu_s(gateway.proc.pid)
            time.sleep(
                busy_wall
            )  # the same time idle: the gateway's own refresh loop, heartbeats read
            idle_cpu = cpu_s(gateway.proc.pid) - cpu_before
        fleet = json.loads(body)["fleet"]
        latencies.sort()
        per_call_ms = max(busy_cpu - idle_cpu, 0) / args.calls * 1000
        print(
            f"fleet: {len(fleet['nodes'])} nodes, {args.per_node} models each of {args.models}; "
            f"{len(fleet['queues'])} queues"
        )
        print(
            f"GET /dashboard/data x {args.calls}: p50 {latencies[len(latencies) // 2] * 1000:.1f} ms, "
            f"p95 {latencies[int(len(latencies) * 0.95)] * 1000:.1f} ms, {size / 1024:.0f} KiB of JSON"
        )
        print(
            f"gateway CPU per call: {per_call_ms:.1f} ms (over the calls {busy_cpu:.2f} s, idle as long {idle_cpu:.2f} s)"
            f" -> one open page (a call every {POLL_S:g} s) takes {per_call_ms / (POLL_S * 1000) * 100:.1f}% of a core"
        )
    finally:
        stop.set()
        if gateway is not None:
            gateway.stop()
        server.stop()


if __name__ == "__main__":
    main()
