"""`scripts/bench --workload fleet`: what a request costs the control plane as the fleet grows
(issue 48). For each fleet size of `--sim-nodes`, a fresh bus (one redis-server, or with
`--cluster` the 3-master Redis Cluster of tests/redis_cluster.py), `--gateways` real gateways
(`python -m gateway`) and the simulated fleet (`python -m node_agent --simulate`, node_agent/sim/:
the real node agent over a synthetic engine, `--nodes-per-process` nodes to a process), with
`--models` catalogue models: all but `--cold` pinned and spread over the nodes at start (as many
replicas as fit one a node, at least one each: 10 nodes hold ~10 models each, 1,000 nodes ~10
replicas of each), the cold ones placed by the first request for them. Then, in order:

1. idle (`--idle-s`): the fleet's own load on Redis (heartbeats and the nodes' idle reads):
   commands/s by command, Redis CPU (INFO cpu), and the gateways' CPU;
2. the request mix (`--requests`, `--concurrency` at once, over the gateways in turn): of every 20,
   12 streamed chats from 8 conversations that share long system prompts (each conversation on one
   model), 7 short non-streamed completions over every warm model, and 1 streamed chat to a cold
   model. Per request: the Redis commands the gateways sent (`redis-cli monitor` on every master,
   each command told by its client's port, a script's commands counted with its sender), by
   command, less what they send when idle (their metrics refresh: every model's queues every 2 s,
   measured the same way over a second idle window; a command's figure never below 0, as the
   refresh comes in bursts); every command Redis ran (INFO commandstats), less the idle rate over the same time
   (`_all`: rough, the nodes' idle reads vary); gateway CPU ms (/proc of the gateway processes, less
   their idle rate); admit-to-start p50/p99 (the done event's `queue_ms` the gateways log: the
   gateway's enqueue, after placement and routing, to the engine's admission); the first request
   of each cold model's time to its first token (placement, load `--load-s` included);
3. the janitor's sweep (gateway/fleet/janitor.py) run 3 times in this process, timed: the gateways run
   without their janitor (`janitor_interval_s` a day), so that a request's commands are told apart
   from a sweep's; this process runs it once a second during step 4;
4. a node's death: a slow simulated node (one step a minute, room for that model alone) and sim-0
   serve the model `requeue`; `2 * slots` completions are sent, and once the slow node holds some
   it is killed (SIGKILL): the time from the kill to the last of them served elsewhere (the janitor
   requeues a dead node's jobs once its heartbeat is older than `node_ttl_s`);
5. Redis memory (INFO memory).

One JSON row per fleet size (see ROW_FIELDS); nothing asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import sys
import tempfile
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_core import Procs, finite, log, one_http, percentile, wait_until  # noqa: E402

PY = sys.executable
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
SLOTS = 8
MEMORY_MB = 1000
REQUEUE_MODEL = "requeue"
CONVERSATIONS = 8
ROW_FIELDS = (
    "nodes",
    "models",
    "gateways",
    "bus",
    "requests",
    "errors",
    "redis_cmds_per_request",
    "redis_cmds_per_request_by_command",
    "redis_cmds_per_request_all",
    "redis_cmds_per_request_all_by_command",
    "gateway_cpu_ms_per_request",
    "admit_to_start_ms_p50",
    "admit_to_start_ms_p99",
    "cold_placement_s",
    "heartbeat_cmds_per_s",
    "heartbeat_cmds_by_command",
    "heartbeat_redis_cpu",
    "gateway_background_cmds_per_s",
    "gateway_background_by_command",
    "redis_cpu_during_requests",
    "redis_memory_mb",
    "janitor_sweep_ms",
    "janitor_cmds_per_sweep",
    "dead_node_requeue_s",
    "load_avg",
)
QUEUE_MS = re.compile(r"done: .* queue (\d+)ms")
MONITOR_LINE = re.compile(r'^[\d.]+ \[\d+ ([^\]]+)\] "([^"]+)"', re.M)


# ---- measurements ------------------------------------------------------------------------------


class RedisMeter:
    """Commands by command and CPU seconds, summed over the bus's masters."""

    def __init__(self, ports: list[int]):
        import redis

        self.clients = [redis.Redis(port=p, socket_timeout=10) for p in ports]

    def sample(self) -> tuple[float, dict[str, int], float]:
        """(monotonic time, calls by command, CPU seconds)."""
        calls: dict[str, int] = {}
        cpu = 0.0
        for client in self.clients:
            for name, stat in client.info("commandstats").items():
                command = name.removeprefix("cmdstat_")
                calls[command] = calls.get(command, 0) + int(stat["calls"])
            info = client.info("cpu")
            cpu += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
        return time.monotonic(), calls, cpu

    def memory_mb(self) -> float:
        return sum(c.info("memory")["used_memory"] for c in self.clients) / 2**20

    def close(self) -> None:
        for client in self.clients:
            client.close()


def delta(before, after) -> tuple[float, dict[str, int], float]:
    """(seconds, calls by command, CPU seconds) between two samples."""
    (t0, c0, cpu0), (t1, c1, cpu1) = before, after
    return t1 - t0, {k: v - c0.get(k, 0) for k, v in c1.items() if v - c0.get(k, 0)}, cpu1 - cpu0


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc/PID/stat)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) * TICK_S
    return total


def logged_queue_ms(logs: list[Path], offsets: list[int]) -> list[float]:
    """The `queue` times of the jobs the gateways logged as done after `offsets` (bytes)."""
    found = []
    for path, offset in zip(logs, offsets):
        with open(path, "rb") as f:
            f.seek(offset)
            found += [float(m) for m in QUEUE_MS.findall(f.read().decode(errors="replace"))]
    return found


# ---- the fleet ---------------------------------------------------------------------------------


def catalogue(args) -> tuple[list[str], list[str], str]:
    """(warm models, cold models, models.toml text): the warm ones (and `requeue`) pinned."""
    models = [f"m-{i:03d}" for i in range(args.models)]
    warm, cold = models[: args.models - args.cold], models[args.models - args.cold :]
    text = "".join(
        f'[[models]]\nid = "{m}"\nsource = "sim:{m}"\nmemory_mb = {MEMORY_MB}\nslots = {SLOTS}\n'
        f"pin = {str(m not in cold).lower()}\n"
        for m in models + [REQUEUE_MODEL]
    )
    return warm, cold, text


@contextmanager
def bus(cluster: bool, workdir: Path):
    """(CORTEX_REDIS_URL, extra env, master ports) of a fresh bus."""
    from shared import processes
    from tests.redis_cluster import running_cluster

    procs = Procs(workdir)
    try:
        port = processes.free_port()
        procs.start("redis", processes.redis_server_argv(port, workdir=workdir))
        url = f"redis://127.0.0.1:{port}/0"
        wait_until("redis", lambda: processes.redis_answers(url), 20, procs, 0.05)
        if not cluster:
            yield url, {}, [port]
            return
        with running_cluster(workdir / "cluster", masters=3, replicas=0) as c:
            yield c.url, {"CORTEX_BATCH_REDIS_URL": url}, c.masters()
    finally:
        procs.stop_all()


@contextmanager
def fleet(args, nodes: int, workdir: Path):
    """The bus, gateways and simulated nodes of one fleet size, ready; yields a dict of handles."""
    import redis

    from shared.keys import Keys
    from shared.processes import free_port

    warm, cold, toml = catalogue(args)
    (workdir / "models.toml").write_text(toml)
    with bus(args.cluster, workdir) as (url, extra, masters):
        procs = Procs(workdir)
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "CORTEX_REDIS_URL": url,
            "CORTEX_MODELS_FILE": str(workdir / "models.toml"),
            "CORTEX_LOG_LEVEL": "WARNING",
            "CORTEX_MODELS_DIR": str(workdir / "models"),
            "CORTEX_JANITOR_INTERVAL_S": "86400",  # the bench runs the janitor itself (`janitor`)
            **extra,
        }
        try:
            gateways, logs, pids = [], [], []
            for g in range(args.gateways):
                port = free_port()
                proc = procs.start(
                    f"gateway-{g}",
                    [PY, "-m", "gateway"],
                    {**env, "CORTEX_PORT": str(port), "CORTEX_LOG_LEVEL": "INFO"},
                )
                gateways.append(f"http://127.0.0.1:{port}")
                logs.append(workdir / f"gateway-{g}.log")
                pids.append(proc.pid)
            # every node holds some: 10 nodes ~10 models each, 1,000 nodes ~10 replicas of each
            spread = [warm[k % len(warm)] for k in range(max(nodes - 1, len(warm)))]
            preload = ",".join([REQUEUE_MODEL, *spread])  # `requeue` on sim-0
            sim = [
                "--step-ms",
                str(args.step_ms),
                "--load-s",
                str(args.load_s),
                "--fleet-size",
                str(nodes),
            ]
            for first in range(0, nodes, args.nodes_per_process):
                count = min(args.nodes_per_process, nodes - first)
                procs.start(
                    f"sim-{first}",
                    [PY, "-m", "node_agent", "--simulate", str(count), "--first", str(first)]
                    + ["--preload", preload, *sim],
                    env,
                )
            victim = procs.start(
                "victim",
                [PY, "-m", "node_agent", "--simulate", "1", "--prefix", "victim"]
                + ["--preload", REQUEUE_MODEL, "--step-ms", "60000", "--memory-mb", str(MEMORY_MB)],
                env,
            )
            keys = Keys(cluster=args.cluster)
            client = (
                redis.RedisCluster(host="127.0.0.1", port=masters[0])
                if args.cluster
                else redis.Redis.from_url(url)
            )

            def ready() -> bool:
                if client.zcard(keys.nodes()) < nodes + 1:
                    return False
                with client.pipeline(transaction=False) as pipe:
                    for n in [f"sim-{i}" for i in range(nodes)] + ["victim-0"]:
                        pipe.hget(keys.node(n), "models")
                    held = pipe.execute()
                loaded = sum((h or b"").count(b'"ready"') for h in held)
                return loaded >= len(warm) + 2

            wait_until(f"{nodes} simulated nodes ready", ready, args.start_timeout, procs, 1.0)
            for g in gateways:
                wait_until(f"gateway {g}", lambda g=g: _http_ok(f"{g}/health"), 60, procs, 0.2)
            handles = dict(gateways=gateways, logs=logs, pids=pids, masters=masters, url=url)
            yield handles | dict(warm=warm, cold=cold, victim=victim, client=client, keys=keys)
        except Exception:
            for child in procs.supervisor.children:
                log(f"{child.name} log tail:\n{procs.tail(child.name)}")
            raise
        finally:
            procs.stop_all()


def _http_ok(url: str) -> bool:
    import httpx

    return httpx.get(url, timeout=2).status_code == 200


# ---- the request mix ---------------------------------------------------------------------------


def system_prompt(c: int) -> str:
    return (
        f"You are assistant number {c} of the fleet benchmark. "
        + "Answer briefly, cite nothing, keep to the point and stay polite. " * 12
    )


def request_mix(args, gateways: list[str], warm: list[str], cold: list[str]):
    """The fixed mix: (URL, body, cold model or None) per request, in sending order."""
    out = []
    for i in range(args.requests):
        gateway = gateways[i % len(gateways)]
        slot = i % 20
        if slot < 12:
            c = i % CONVERSATIONS
            body = {
                "model": warm[c * len(warm) // CONVERSATIONS],
                "stream": True,
                "max_tokens": 16,
                "messages": [
                    {"role": "system", "content": system_prompt(c)},
                    {"role": "user", "content": f"Question {i}: what is {i} squared?"},
                ],
            }
            out.append((f"{gateway}/v1/chat/completions", body, None))
        elif slot < 19:
            body = {"model": warm[(i * 7) % len(warm)], "prompt": f"Item {i}:", "max_tokens": 4}
            out.append((f"{gateway}/v1/completions", body, None))
        else:
            model = cold[(i // 20) % len(cold)] if cold else warm[0]
            body = {
                "model": model,
                "stream": True,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": f"Cold question {i}"}],
            }
            out.append((f"{gateway}/v1/chat/completions", body, model if cold else None))
    return out


async def _one(client, url: str, body: dict):
    """A streamed request through bench_core's client; a non-streamed one timed here."""
    if body.get("stream"):
        return await one_http(client, url, body)
    from bench_core import Stream

    s, t0 = Stream(), time.perf_counter()
    try:
        r = await client.post(url, json=body)
        if r.status_code != 200:
            s.error = f"HTTP {r.status_code}: {r.text[:300]}"
        else:
            s.tokens = r.json()["usage"]["completion_tokens"]
    except Exception as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.total_s = s.ttft_s = time.perf_counter() - t0
    return s


async def drive(requests, concurrency: int, timeout_s: float):
    """Every request, `concurrency` at once, in order; (streams, first-request TTFT per cold model)."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:

        async def one(url, body):
            async with gate:
                return await _one(client, url, body)

        streams = await asyncio.gather(*(one(url, body) for url, body, _ in requests))
    firsts: dict[str, float] = {}
    for (_, _, model), s in zip(requests, streams):
        if model is not None and model not in firsts:
            firsts[model] = s.ttft_s
    return streams, firsts


# ---- one fleet size ----------------------------------------------------------------------------


@contextmanager
def monitored(ports: list[int], workdir: Path):
    """`redis-cli monitor` on every master while the block runs; yields a list filled, on the way
    out, with (client port or 0 for a script's commands, command) per command Redis ran."""
    import shutil
    import subprocess

    files = [workdir / f"monitor-{port}.txt" for port in ports]
    procs = [
        subprocess.Popen(
            [shutil.which("redis-cli"), "-p", str(port), "monitor"], stdout=open(path, "wb")
        )
        for port, path in zip(ports, files)
    ]
    seen: list[tuple[int, str]] = []
    try:
        time.sleep(0.3)
        yield seen
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    for path in files:
        for m in MONITOR_LINE.finditer(path.read_text(errors="replace")):
            client, command = m.group(1), m.group(2).lower()
            seen.append((0 if client == "lua" else int(client.rsplit(":", 1)[1]), command))
        path.unlink()


def owned_ports(pids: list[int], redis_ports: list[int]) -> set[int]:
    """The local ports of these processes' connections to the bus."""
    import psutil

    return {
        c.laddr.port
        for pid in pids
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port in redis_ports
    }


def attributed(seen: list[tuple[int, str]], ports: set[int]) -> dict[str, int]:
    """Commands by command sent from `ports`, a script's inner commands counted with its EVALSHA's
    sender (a script runs alone: its commands follow it in MONITOR's output)."""
    counted: dict[str, int] = {}
    owner = False
    for port, command in seen:
        if port:
            owner = port in ports
        if owner:
            name = command if port else f"{command} (in a script)"
            counted[name] = counted.get(name, 0) + 1
    return counted


@asynccontextmanager
async def janitor(url: str, cluster: bool, view: bool = True):
    """The gateway's janitor (gateway/fleet/janitor.py), run here on the fleet's Redis with a fleet
    view as a gateway has (`view`): the bench's gateways run without theirs, so that a request's
    commands are told apart from a sweep's."""
    from gateway.fleet.janitor import Janitor
    from gateway.fleet.placement import Placer
    from shared.catalog import Catalog
    from shared.fleet import Fleet
    from shared.fleet_view import FleetView
    from shared.keys import Keys
    from shared.redis_conn import connect
    from shared.settings import GatewaySettings

    settings = GatewaySettings(redis_url=url, janitor_interval_s=1.0)
    redis = connect(url)
    keys = Keys(settings.key_prefix, cluster=cluster)
    fleet_view = FleetView(redis, keys, settings.node_ttl_s) if view else None
    if fleet_view is not None:
        await fleet_view.start()
    fleet = Fleet(redis, keys, settings.node_ttl_s, view=fleet_view)
    try:
        yield Janitor(Placer(redis, keys, settings, Catalog.load(settings.models_file), fleet))
    finally:
        if fleet_view is not None:
            await fleet_view.stop()
        await redis.aclose()


def janitor_sweeps(url: str, cluster: bool, times: int = 3) -> list[float]:
    """Seconds of `times` janitor sweeps, one after another."""

    async def sweeps() -> list[float]:
        took = []
        async with janitor(url, cluster) as j:
            for _ in range(times):
                t0 = time.perf_counter()
                await j.sweep()
                took.append(time.perf_counter() - t0)
        return took

    return asyncio.run(sweeps())


def dead_node(args, f: dict) -> float | None:
    """Seconds from the slow node's death to the last of `2 * SLOTS` completions served, the janitor
    running; None when the slow node took none of them within 30 s."""
    import httpx

    client, keys = f["client"], f["keys"]
    stream = keys.jobs(REQUEUE_MODEL)

    def held() -> int:
        try:
            return sum(
                int(c["pending"])
                for c in client.xinfo_consumers(stream, "agents")
                if c["name"] in ("victim-0", b"victim-0")
            )
        except Exception:
            return 0

    async def sweeping(j) -> None:  # the janitor's round, once a second (the bench holds no lock)
        while True:
            await j.sweep()
            await asyncio.sleep(1.0)

    async def run() -> float | None:
        async with janitor(f["url"], args.cluster) as j, httpx.AsyncClient(timeout=600) as http:
            rounds = asyncio.create_task(sweeping(j))
            body = {"model": REQUEUE_MODEL, "prompt": "Requeue me", "max_tokens": 4}
            sent = [
                asyncio.create_task(http.post(f"{f['gateways'][0]}/v1/completions", json=body))
                for _ in range(2 * SLOTS)
            ]
            deadline = time.monotonic() + 30
            while not (taken := held()) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            os.killpg(f["victim"].pid, signal.SIGKILL)
            killed = time.monotonic()
            replies = await asyncio.gather(*sent, return_exceptions=True)
            ended = time.monotonic()
            rounds.cancel()
            await asyncio.gather(rounds, return_exceptions=True)
        bad = [r for r in replies if isinstance(r, Exception) or r.status_code != 200]
        if bad:
            log(f"dead node: {len(bad)} of {len(sent)} failed: {bad[0]}")
        log(f"dead node: the victim held {taken} jobs when killed")
        return ended - killed if taken else None

    return asyncio.run(run())


def per_request(calls: dict[str, int], n: int) -> dict[str, float]:
    return {c: round(v / n, 2) for c, v in sorted(calls.items(), key=lambda kv: -kv[1])}


def measure(args, nodes: int, workdir: Path) -> dict:
    with fleet(args, nodes, workdir) as f:
        meter = RedisMeter(f["masters"])
        pids = f["pids"]
        requests = request_mix(args, f["gateways"], f["warm"], f["cold"])
        warm_up = request_mix(
            argparse.Namespace(requests=len(f["gateways"]) * 2), f["gateways"], f["warm"], []
        )
        asyncio.run(drive([r for r in warm_up if r[2] is None], 4, args.timeout))
        log(f"{nodes} nodes: idle for {args.idle_s:g} s")
        g0, r0 = cpu_s(pids), meter.sample()
        time.sleep(args.idle_s)
        g1, r1 = cpu_s(pids), meter.sample()
        idle_s, idle_calls, idle_cpu = delta(r0, r1)
        gateway_idle = (g1 - g0) / idle_s
        with monitored(f["masters"], workdir) as seen:  # the gateways' own background work
            t0 = time.monotonic()
            time.sleep(args.idle_s)
            quiet_s = time.monotonic() - t0
        background = attributed(seen, owned_ports(pids, f["masters"]))
        log(f"{nodes} nodes: {len(requests)} requests, {args.concurrency} at once")
        offsets = [p.stat().st_size for p in f["logs"]]
        with monitored(f["masters"], workdir) as seen:
            g0, r0 = cpu_s(pids), meter.sample()
            streams, firsts = asyncio.run(drive(requests, args.concurrency, args.timeout))
            g1, r1 = cpu_s(pids), meter.sample()
        wave_s, wave_calls, wave_cpu = delta(r0, r1)
        n = len(requests)
        gateway_calls = {  # a command the background sends in bursts is never below 0
            c: max(0, round(v - background.get(c, 0) * wave_s / quiet_s))
            for c, v in attributed(seen, owned_ports(pids, f["masters"])).items()
        }
        everything = {
            c: wave_calls.get(c, 0) - idle_calls.get(c, 0) * wave_s / idle_s
            for c in set(wave_calls) | set(idle_calls)
        }
        queue_ms = logged_queue_ms(f["logs"], offsets)
        errors = [s.error for s in streams if s.error]
        if errors:
            log(f"{len(errors)} errors, the first: {errors[0]}")
        r0 = meter.sample()
        sweeps = janitor_sweeps(f["url"], args.cluster)
        sweep_s, sweep_calls, _ = delta(r0, meter.sample())
        sweep_cmds = (
            sum(sweep_calls.values()) - sum(idle_calls.values()) * sweep_s / idle_s
        ) / len(sweeps)
        requeue_s = dead_node(args, f)
        row = dict(
            nodes=nodes,
            models=args.models,
            gateways=args.gateways,
            bus="3-master cluster" if args.cluster else "one Redis",
            requests=n,
            errors=len(errors),
            redis_cmds_per_request=round(sum(gateway_calls.values()) / n, 1),
            redis_cmds_per_request_by_command=per_request(gateway_calls, n),
            redis_cmds_per_request_all=round(sum(everything.values()) / n, 1),
            redis_cmds_per_request_all_by_command=per_request(
                {c: round(v) for c, v in everything.items()}, n
            ),
            gateway_cpu_ms_per_request=round(1000 * ((g1 - g0) - gateway_idle * wave_s) / n, 2),
            admit_to_start_ms_p50=percentile(queue_ms, 50),
            admit_to_start_ms_p99=percentile(queue_ms, 99),
            cold_placement_s=percentile(list(firsts.values()), 50),
            heartbeat_cmds_per_s=round(sum(idle_calls.values()) / idle_s, 1),
            heartbeat_cmds_by_command={
                c: round(v / idle_s, 1)
                for c, v in sorted(idle_calls.items(), key=lambda kv: -kv[1])
            },
            heartbeat_redis_cpu=round(idle_cpu / idle_s, 3),
            gateway_background_cmds_per_s=round(sum(background.values()) / quiet_s, 1),
            gateway_background_by_command=per_request(background, quiet_s),
            redis_cpu_during_requests=round(wave_cpu / wave_s, 3),
            redis_memory_mb=round(meter.memory_mb(), 1),
            janitor_sweep_ms=round(1000 * sum(sweeps) / len(sweeps), 1),
            janitor_cmds_per_sweep=round(sweep_cmds, 1),
            dead_node_requeue_s=requeue_s,
            load_avg=os.getloadavg()[0],
        )
        meter.close()
        return row


# ---- the report --------------------------------------------------------------------------------


def print_report(rows: list[dict]) -> None:
    print(
        "\n| nodes | bus | requests | errors | Redis cmds/request | gateway CPU ms/request | "
        "admit→start p50 / p99 ms | cold placement s | idle Redis cmds/s | idle Redis CPU | "
        "Redis MB | janitor sweep ms | dead node → served s |"
    )
    print("|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(
            f"| {r['nodes']} | {r['bus']} | {r['requests']} | {r['errors']} | "
            f"{r['redis_cmds_per_request']} | {r['gateway_cpu_ms_per_request']} | "
            f"{_f(r['admit_to_start_ms_p50'])} / {_f(r['admit_to_start_ms_p99'])} | "
            f"{_f(r['cold_placement_s'], 2)} | {r['heartbeat_cmds_per_s']} | "
            f"{r['heartbeat_redis_cpu']:.0%} | {r['redis_memory_mb']} | {r['janitor_sweep_ms']} | "
            f"{_f(r['dead_node_requeue_s'], 1)} |"
        )
    for r in rows:
        top = ", ".join(
            f"{c} {v}" for c, v in list(r["redis_cmds_per_request_by_command"].items())[:8]
        )
        print(f"{r['nodes']} nodes, per request: {top}")
    for r in rows:
        top = ", ".join(f"{c} {v}" for c, v in list(r["heartbeat_cmds_by_command"].items())[:8])
        print(f"{r['nodes']} nodes, idle per second: {top}")


def _f(value, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="scripts/bench --workload fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", choices=["fleet"], default="fleet")
    p.add_argument("--sim-nodes", default="10,100,1000", help="fleet sizes, comma-separated")
    p.add_argument("--models", type=int, default=100, help="catalogue models (default 100)")
    p.add_argument("--cold", type=int, default=5, help="of those, placed on demand (default 5)")
    p.add_argument("--gateways", type=int, default=4, help="gateway processes (default 4)")
    p.add_argument("--cluster", action="store_true", help="on the 3-master Redis Cluster")
    p.add_argument("--requests", type=int, default=200, help="requests of the mix (default 200)")
    p.add_argument("--concurrency", type=int, default=16, help="requests at once (default 16)")
    p.add_argument("--idle-s", type=float, default=10.0, help="the idle window (default 10 s)")
    p.add_argument("--step-ms", type=float, default=20.0, help="a simulated step (default 20)")
    p.add_argument("--load-s", type=float, default=0.5, help="a simulated load (default 0.5 s)")
    p.add_argument("--nodes-per-process", type=int, default=500, help="simulated nodes a process")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds for a fleet to start")
    p.add_argument("--timeout", type=float, default=300, help="seconds one request may take")
    p.add_argument("--json", dest="json_path", default=None, help="write the rows here too")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = p.parse_args(argv)
    args.sizes = [int(x) for x in args.sim_nodes.split(",") if x.strip()]
    if args.cold >= args.models:
        p.error("--cold must leave some warm models")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="cortex-fleet-"))
    failed = False
    try:
        for nodes in args.sizes:
            folder = workdir / f"{nodes}-nodes"
            folder.mkdir()
            try:
                rows.append(measure(args, nodes, folder))
                log(f"{nodes} nodes: {json.dumps(finite(rows[-1]))}")
            except Exception as exc:
                failed = True
                log(f"{nodes} nodes: did not run to the end: {type(exc).__name__}: {exc}")
    finally:
        log(f"logs in {workdir}")
    print_report(rows)
    if args.json_path:
        doc = {"workload": "fleet", "args": vars(args), "rows": rows}
        Path(args.json_path).write_text(json.dumps(finite(doc), indent=2, default=str))
        log(f"wrote {args.json_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
