"""`scripts/bench --workload bus`: the served path on one Redis and on a Redis Cluster, side by side.

The same fleet runs twice, on a fresh bus each time: `--bus-models` models (each its own job
streams; the benchmarked model's weights under several ids), `--bus-gateways` gateways and
`--nodes` node agents (each serving every model), then the streams of `--concurrency` spread over
models and gateways. Reported per bus: aggregate tok/s, TTFT p50, and the Redis commands each shard
(master) executed during the wave (INFO commandstats before and after), so a reader sees the load
spread. The cluster is `tests/redis_cluster.py`'s: 3 masters on loopback, no replicas.
"""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import contextmanager
from pathlib import Path

from bench_core import CpuMeter, Procs, Wave, concurrent_streams, log, wait_until
from bench_servers import PY, openai_body

BUSES = ("one Redis", "3-master cluster")


def _commands(ports: list[int]) -> dict[int, int]:
    import redis

    totals = {}
    for port in ports:
        with redis.Redis(port=port, socket_timeout=5) as client:
            totals[port] = sum(stat["calls"] for stat in client.info("commandstats").values())
    return totals


@contextmanager
def _bus(kind: str, workdir: Path):
    """(CORTEX_REDIS_URL, extra env, master ports) of a fresh bus."""
    from shared import processes
    from tests.redis_cluster import running_cluster

    if kind == BUSES[0]:
        procs = Procs(workdir)
        port = processes.free_port()
        procs.start("redis", processes.redis_server_argv(port, workdir=workdir))
        try:
            wait_until(
                "redis",
                lambda: processes.redis_answers(f"redis://127.0.0.1:{port}/0"),
                20,
                procs,
                0.05,
            )
            yield f"redis://127.0.0.1:{port}/0", {}, [port]
        finally:
            procs.stop_all()
        return
    queue = Procs(workdir)
    qport = processes.free_port()
    queue.start("batch-queue", processes.redis_server_argv(qport, workdir=workdir))
    try:
        with running_cluster(workdir / "cluster", masters=3, replicas=0) as cluster:
            yield (
                cluster.url,
                {"CORTEX_BATCH_REDIS_URL": f"redis://127.0.0.1:{qport}/0"},
                cluster.masters(),
            )
    finally:
        queue.stop_all()


@contextmanager
def _fleet(args, kind: str, workdir: Path):
    """The fleet on a fresh bus; yields (gateway URLs, model ids, master ports)."""
    import httpx

    from shared.processes import free_port

    models = [f"{args.model_id}-{i}" for i in range(args.bus_models)]
    with _bus(kind, workdir) as (url, extra, masters):
        procs = Procs(workdir)
        try:
            catalogue = workdir / "models.toml"
            catalogue.write_text(
                "".join(
                    f'[[models]]\nid = "{m}"\nsource = "{args.model_source}"\nslots = {args.slots}\n'
                    f'dtype = "{args.dtype}"\nmax_model_len = {args.max_model_len}\npin = true\n'
                    for m in models
                )
            )
            env = {
                **os.environ,
                "CORTEX_REDIS_URL": url,
                "CORTEX_MODELS_FILE": str(catalogue),
                "CORTEX_LOG_LEVEL": "WARNING",
                **extra,
            }
            gateways = []
            for g in range(args.bus_gateways):
                port = free_port()
                procs.start(
                    f"gateway-{g}", [PY, "-m", "gateway"], {**env, "CORTEX_PORT": str(port)}
                )
                gateways.append(f"http://127.0.0.1:{port}")
            threads = str(max(1, ((os.cpu_count() or 2) - 1) // args.nodes))
            for n in range(args.nodes):
                procs.start(
                    f"node-{n}",
                    [PY, "-m", "node_agent"],
                    {
                        **env,
                        "CORTEX_NODE_NAME": f"bus-{n}",
                        "CORTEX_MODELS": json.dumps(models),
                        "CORTEX_DEVICE": args.device,
                        "CORTEX_TORCH_THREADS": threads,
                    },
                )

            def ready() -> bool:
                listed = [httpx.get(f"{g}/v1/queue", timeout=2).json()["data"] for g in gateways]
                return all(
                    len([q for q in data if q["model"] in models and q["replicas"] >= args.nodes])
                    == len(models)
                    for data in listed
                )

            wait_until(
                f"{len(models)} models on {args.nodes} nodes behind {len(gateways)} gateways",
                ready,
                600,
                procs,
                0.5,
            )
            yield gateways, models, masters
        except Exception:
            log(
                "".join(
                    f"\n{child.name} log tail:\n" + procs.tail(child.name)
                    for child in procs.supervisor.children
                )
            )
            raise
        finally:
            procs.stop_all()


def _requests(
    gateways: list[str], models: list[str], n: int, max_tokens: int
) -> list[tuple[str, dict]]:
    """`n` streams spread over the gateways and the models."""
    return [
        (
            f"{gateways[i % len(gateways)]}/v1/chat/completions",
            openai_body(models[i % len(models)])(
                [{"role": "user", "content": f"Write story number {i}."}], max_tokens
            ),
        )
        for i in range(n)
    ]


def run(args, workdir: Path) -> list[dict]:
    """Each bus in turn on a fresh fleet; one row per bus and concurrency."""
    rows = []
    for kind in BUSES:
        folder = workdir / kind.replace(" ", "-")
        folder.mkdir(parents=True, exist_ok=True)
        with _fleet(args, kind, folder) as (gateways, models, masters):
            asyncio.run(
                concurrent_streams(
                    _requests(gateways, models, len(models) * len(gateways), 4),  # warm every path
                    args.timeout,
                )
            )
            for n in args.concurrency:
                before = _commands(masters)
                with CpuMeter() as cpu:
                    wall, streams = asyncio.run(
                        concurrent_streams(
                            _requests(gateways, models, n, args.max_tokens), args.timeout
                        )
                    )
                after = _commands(masters)
                summary = Wave(kind, n, wall, streams, cpu.other_pct, cpu.cores).summary()
                shards = {port: after[port] - before[port] for port in masters}
                rows.append(
                    {
                        "bus": kind,
                        "concurrency": n,
                        "tok_s": summary["aggregate_tok_s"],
                        "ttft_p50_ms": summary["ttft_p50_ms"],
                        "errors": summary["errors"],
                        "commands": sum(shards.values()),
                        "per_shard": sorted(shards.values(), reverse=True),
                        "commands_per_token": sum(shards.values()) / max(summary["tokens"], 1),
                    }
                )
                log(f"{kind} N={n}: {rows[-1]}")
    return rows


def print_report(rows: list[dict]) -> None:
    print(
        "\n| bus | N | tok/s | TTFT p50 ms | errors | Redis commands | per shard (busiest first) | commands/token |"
    )
    print("|---|--:|--:|--:|--:|--:|---|--:|")
    for r in rows:
        print(
            f"| {r['bus']} | {r['concurrency']} | {r['tok_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['errors']} | "
            f"{r['commands']} | {' / '.join(map(str, r['per_shard']))} | {r['commands_per_token']:.2f} |"
        )
    for n in sorted({r["concurrency"] for r in rows}):
        one, cluster = (
            next((r for r in rows if r["bus"] == b and r["concurrency"] == n), None) for b in BUSES
        )
        if one and cluster and one["tok_s"]:
            print(
                f"N={n}: cluster / one Redis tok/s {cluster['tok_s'] / one['tok_s']:.2f}; "
                f"busiest shard's share of the cluster's commands {cluster['per_shard'][0] / cluster['commands']:.2f}"
            )
