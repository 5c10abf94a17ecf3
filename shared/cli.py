"""The `cortex` command: run one part (`gateway`, `node`), run them all at once (`up`), or look
at the fleet (`status`).

    cortex up                      # redis-server + gateway + batch worker + one node agent, in the foreground
    cortex gateway --port 31313    # one gateway replica
    cortex node --models SmolLM2-135M-Instruct
    cortex batch-worker            # an arq worker running /v1/batches (as many as you like)
    cortex status [--json]         # nodes, devices, memory, models, slots, queues (from Redis)
    cortex keys create --name NAME # API keys: create | list | show | revoke (in Redis)

Flags override settings; everything else comes from `CORTEX_*` variables and the TOML file named
by `CORTEX_CONFIG` (see `shared/settings.py`). The gateway and node packages are imported only by
the command that runs them, so `cortex status` starts fast and needs no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from pydantic import BaseModel, ValidationError

from shared import queues as job_queues
from shared.heartbeat import NodeHeartbeat
from shared.keys import CONSUMER_GROUP, Keys
from shared.lifecycle import ModelState
from shared.redis_conn import redact
from shared.settings import GatewaySettings, NodeSettings

UP_REDIS_PORT = 31379
CLI_NAME = "cortex"


# --------------------------------------------------------------------------------------------
# Reading the fleet from Redis (what `cortex status` shows)
# --------------------------------------------------------------------------------------------


class DeviceStatus(BaseModel):
    id: str
    name: str
    total_mb: int
    free_mb: int
    used_mb: int


class ModelStatus(BaseModel):
    state: str
    device: str
    slots_used: int
    slots_total: int
    memory_mb: int = 0
    last_used_ms: int = 0  # when a job last ended (or the model became ready); 0: unknown
    idle_s: float | None = None  # seconds since last_used_ms; None when unknown
    queue_depth: int = 0  # jobs no node has read yet, over all of the model's streams (fleet-wide)
    error: str = ""


class NodeStatus(BaseModel):
    node: str
    alive: bool
    heartbeat_ms: int  # from the hash when present, else the `cortex:nodes` score
    heartbeat_age_s: float
    version: str = ""
    state: str = "gone"  # active | draining | drained | gone (no heartbeat hash: expired or shut down)
    labels: list[str] = []
    started_ms: int = 0
    devices: list[DeviceStatus] = []
    models: dict[str, ModelStatus] = {}
    error: str = ""  # the hash could not be read


class QueueStatus(BaseModel):
    model: str
    length: int  # XLEN: entries kept in the stream, served or not
    waiting: int  # not yet read by any node (entries beyond the pending ones)
    in_flight: int  # read by a node, not yet acknowledged (XPENDING)
    consumers: int
    # every priority class and band (shared/queues.py); the fields above are the default stream's
    queued: dict[str, int] = {}  # class -> jobs no node has read yet
    running: int = 0  # jobs read by a node, not yet finished, all classes
    oldest_wait_s: float | None = None  # the longest any queued job has waited


class CatalogModelStatus(BaseModel):
    """A catalogue model (`cortex:catalog`) that no live node holds."""

    model: str
    state: str = "not loaded"
    memory_mb: int | None = None
    pin: bool = False
    queue_depth: int = 0


class FleetStatus(BaseModel):
    now_ms: int
    nodes: list[NodeStatus]
    queues: list[QueueStatus]
    not_loaded: list[CatalogModelStatus] = []


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def read_node(r: redis.Redis, keys: Keys, node: str, score_ms: int, *, node_ttl_s: float, now_ms: int) -> NodeStatus:
    """One node's row: its heartbeat hash if it still exists, else a `gone` row from its score."""
    fields = r.hgetall(keys.node(node))
    if not fields:
        return NodeStatus(node=node, alive=False, heartbeat_ms=score_ms, heartbeat_age_s=(now_ms - score_ms) / 1000)
    try:
        hb = NodeHeartbeat.from_hash(fields)
    except (ValidationError, ValueError) as exc:
        return NodeStatus(
            node=node, alive=False, heartbeat_ms=score_ms, heartbeat_age_s=(now_ms - score_ms) / 1000,
            state="unreadable", error=str(exc).splitlines()[0],
        )
    age_s = (now_ms - hb.heartbeat_ms) / 1000
    return NodeStatus(
        node=node,
        alive=age_s <= node_ttl_s,
        heartbeat_ms=hb.heartbeat_ms,
        heartbeat_age_s=age_s,
        version=hb.version,
        state=hb.state,
        labels=hb.labels,
        started_ms=hb.started_ms,
        devices=[DeviceStatus(**d.model_dump(), used_mb=d.total_mb - d.free_mb) for d in hb.devices],
        models={
            name: ModelStatus(
                state=str(m.state), device=m.device, slots_used=m.slots_used, slots_total=m.slots_total,
                memory_mb=m.memory_mb, last_used_ms=m.last_used_ms,
                idle_s=max(0.0, (now_ms - m.last_used_ms) / 1000) if m.last_used_ms else None, error=m.error,
            )
            for name, m in hb.models.items()
        },
    )


def read_queue(r: redis.Redis, keys: Keys, model: str) -> QueueStatus | None:
    """Depth of one model's job streams; None when none of them exists."""
    pairs = job_queues.streams(keys, model)
    if not r.exists(*[s for _, s in pairs]):
        return None
    summary = job_queues.summarize(model, [c for c, _ in pairs], r.register_script(job_queues.QUEUE_STATS_LUA)(
        keys=[s for _, s in pairs], args=[CONSUMER_GROUP]))
    stream = keys.jobs(model)
    length = r.xlen(stream)
    group = next(
        (g for g in r.xinfo_groups(stream) if _text(g["name"]) == CONSUMER_GROUP),
        None,
    ) if length or r.exists(stream) else None
    if group is None:  # nobody has ever consumed this model's default stream: everything there waits
        return QueueStatus(model=model, length=length, waiting=length, in_flight=0, consumers=0,
                           queued=summary["queued"], running=summary["running"],
                           oldest_wait_s=summary["oldest_wait_s"])
    return QueueStatus(
        model=model,
        length=length,
        waiting=max(length - int(group["pending"]), 0),  # not the group's lag, which deletions leave stale
        in_flight=int(group["pending"]),
        consumers=int(group["consumers"]),
        queued=summary["queued"],
        running=summary["running"],
        oldest_wait_s=summary["oldest_wait_s"],
    )


def read_fleet(r: redis.Redis, keys: Keys, *, node_ttl_s: float = 8.0, now_ms: int | None = None) -> FleetStatus:
    """Everything `cortex status` shows, read from Redis with a synchronous client."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    nodes = [
        read_node(r, keys, _text(name), int(score), node_ttl_s=node_ttl_s, now_ms=now_ms)
        for name, score in r.zrange(keys.nodes(), 0, -1, withscores=True)
    ]
    nodes.sort(key=lambda n: n.node)
    models = {m for n in nodes for m in n.models}
    jobs_prefix = keys.jobs("")
    models |= {job_queues.model_of(keys, _text(k)) for k in r.scan_iter(match=jobs_prefix + "*", count=500)}
    catalog = {_text(k): v for k, v in r.hgetall(keys.catalog()).items()}
    queues = [q for m in sorted(models | set(catalog)) if (q := read_queue(r, keys, m)) is not None]
    depth = {q.model: sum(q.queued.values()) if q.queued else q.waiting for q in queues}
    for n in nodes:
        for name, m in n.models.items():
            m.queue_depth = depth.get(name, 0)
    held = {name for n in nodes if n.alive for name, m in n.models.items() if m.state != ModelState.FAILED}
    not_loaded = []
    for model in sorted(set(catalog) - held):
        try:
            profile = json.loads(catalog[model])
        except (ValueError, TypeError):
            profile = {}
        not_loaded.append(CatalogModelStatus(model=model, memory_mb=profile.get("memory_mb"),
                                             pin=bool(profile.get("pin", False)), queue_depth=depth.get(model, 0)))
    return FleetStatus(now_ms=now_ms, nodes=nodes, queues=queues, not_loaded=not_loaded)


# --------------------------------------------------------------------------------------------
# Printing it
# --------------------------------------------------------------------------------------------


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _gib(mb: int) -> str:
    return f"{mb / 1024:.1f}"


_STATE_STYLE = {
    ModelState.READY: "green",
    ModelState.LOADING: "yellow",
    ModelState.UNLOADING: "yellow",
    ModelState.POISONED: "red",
    ModelState.FAILED: "red",
}


def render_fleet(fleet: FleetStatus, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not fleet.nodes:
        console.print("No nodes have sent a heartbeat.")
    else:
        table = Table(title="Nodes", title_justify="left")
        for column in ("node", "alive", "heartbeat", "version", "state", "devices (used/total GiB)",
                       "models (slots used/total, queued, idle)"):
            table.add_column(column)
        for n in fleet.nodes:
            devices = "\n".join(f"{d.id} {d.name} {_gib(d.used_mb)}/{_gib(d.total_mb)}" for d in n.devices)
            models = "\n".join(
                f"{name} [{_STATE_STYLE.get(m.state, 'white')}]{m.state}[/] {m.slots_used}/{m.slots_total}"
                f" q={m.queue_depth} idle={'busy' if m.slots_used else (_age(m.idle_s) if m.idle_s is not None else '-')}"
                + (f" ({m.error})" if m.error else "")
                for name, m in sorted(n.models.items())
            )
            table.add_row(
                n.node,
                "[green]yes[/]" if n.alive else "[red]no[/]",
                f"{_age(n.heartbeat_age_s)} ago",
                n.version,
                (n.state if not n.error else f"{n.state}: {n.error}") + (f"\n{','.join(n.labels)}" if n.labels else ""),
                devices or "-",
                models or "-",
            )
        console.print(table)
    if fleet.queues:
        table = Table(title="Queues", title_justify="left")
        for column in ("model", "queued interactive", "queued batch", "running", "oldest wait", "consumers"):
            table.add_column(column, justify="left" if column == "model" else "right")
        for q in fleet.queues:
            oldest = _age(q.oldest_wait_s) if q.oldest_wait_s is not None else "-"
            table.add_row(q.model, str(q.queued.get("interactive", q.waiting)), str(q.queued.get("batch", 0)),
                          str(q.running or q.in_flight), oldest, str(q.consumers))
        console.print(table)
    if fleet.not_loaded:
        table = Table(title="Catalogue models not loaded on any live node", title_justify="left")
        for column in ("model", "state", "memory (MiB)", "pinned", "queued"):
            table.add_column(column, justify="left" if column in ("model", "state") else "right")
        for c in fleet.not_loaded:
            table.add_row(c.model, c.state, str(c.memory_mb) if c.memory_mb is not None else "estimated at load",
                          "yes" if c.pin else "no", str(c.queue_depth))
        console.print(table)


# --------------------------------------------------------------------------------------------
# `cortex up`: a small supervisor for a process tree
# --------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if `cortex up` itself dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    stop_timeout_s: float | None = None  # None: the supervisor's


@dataclass
class Supervisor:
    """Starts children in their own process groups (so a terminal's Ctrl-C reaches only us) and
    stops them in the reverse order of starting, each given `stop_timeout_s` before SIGKILL."""

    stop_timeout_s: float = 10.0
    children: list[Child] = field(default_factory=list)
    signals: int = 0  # how many stop signals arrived; a second one skips the grace period

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              stop_timeout_s: float | None = None) -> Child:
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, process_group=0, preexec_fn=_die_with_parent
        )
        child = Child(name, proc, stop_timeout_s)
        self.children.append(child)
        return child

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop_all(self, log=print) -> None:
        for child in reversed(self.children):
            proc = child.proc
            timeout_s = self.stop_timeout_s if child.stop_timeout_s is None else child.stop_timeout_s
            if proc.poll() is None:
                log(f"stopping {child.name} (pid {proc.pid})")
                _signal(proc, signal.SIGTERM)
                deadline = time.monotonic() + timeout_s
                while proc.poll() is None and time.monotonic() < deadline and self.signals < 2:
                    time.sleep(0.05)
            if proc.poll() is None:
                log(f"{child.name} did not stop in {timeout_s:g}s; killing it")
                _signal(proc, signal.SIGKILL)
                proc.wait()
            # Anything the child left in its process group goes too.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def install_signal_handlers(self) -> None:
        def on_signal(signum, frame):
            self.signals += 1

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _wait_for_redis(url: str, child: Child | None, timeout_s: float = 15.0) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if child is not None and child.proc.poll() is not None:
                return False
            try:
                if client.ping():
                    return True
            except redis.RedisError:
                time.sleep(0.05)
        return False
    finally:
        client.close()


@dataclass
class ReadinessWatch:
    """Tells the operator when the gateway answers and when each model turns ready."""

    redis_url: str
    keys: Keys
    base_url: str
    models: list[str]
    gateway_up: bool = False
    announced: bool = False
    states: dict[tuple[str, str], str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def poll(self, log) -> None:
        if not self.gateway_up:
            import httpx

            try:
                self.gateway_up = httpx.get(self.base_url + "/health", timeout=0.5).status_code < 500
                if self.gateway_up:
                    log(f"gateway answers on {self.base_url}")
            except httpx.HTTPError:
                pass
        try:
            client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=0.5, socket_timeout=1.0)
            try:
                fleet = read_fleet(client, self.keys)
            finally:
                client.close()
        except redis.RedisError:
            return
        ready = set()
        for node in fleet.nodes:
            for name, m in node.models.items():
                if self.states.get((node.node, name)) != m.state:
                    self.states[(node.node, name)] = m.state
                    took = time.monotonic() - self.started
                    log(f"model {name} is {m.state} on node {node.node} ({took:.1f}s)" + (f": {m.error}" if m.error else ""))
                if m.state == ModelState.READY and node.alive:
                    ready.add(name)
        if self.gateway_up and not self.announced and (ready >= set(self.models) if self.models else ready):
            self.announced = True
            log(f"ready: OpenAI-compatible API at {self.base_url}/v1 serving {', '.join(sorted(ready))}; Ctrl-C stops everything")


def run_up(args: argparse.Namespace) -> int:
    def log(message: str) -> None:
        print(f"[cortex up] {message}", flush=True)

    gateway_settings = GatewaySettings(**_overrides(args, host="host", port="port"))
    node_settings = NodeSettings(**_overrides(args, models="models"))
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.config:
        env["CORTEX_CONFIG"] = str(args.config)

    if not _port_free(gateway_settings.host, gateway_settings.port):
        log(f"port {gateway_settings.port} on {gateway_settings.host} is already in use (another `cortex up`?); "
            "stop it or set CORTEX_PORT / --port")
        return 2

    sup = Supervisor(stop_timeout_s=args.stop_timeout_s if args.stop_timeout_s is not None else 10.0)
    sup.install_signal_handlers()
    exit_code = 0
    redis_log: str | None = None  # the embedded redis-server's log, removed unless it failed
    try:
        external = os.environ.get("CORTEX_REDIS_URL")
        if external:
            redis_url = external
            log(f"using Redis at {redact(redis_url)}")
            if not _wait_for_redis(redis_url, None, timeout_s=5):
                log(f"Redis at {redact(redis_url)} does not answer PING")
                return 2
        else:
            port = args.redis_port
            if not _port_free("127.0.0.1", port):
                log(f"port {port} for the embedded Redis is in use; set CORTEX_UP_REDIS_PORT, or CORTEX_REDIS_URL to use that Redis")
                return 2
            redis_url = f"redis://127.0.0.1:{port}/0"
            fd, redis_log = tempfile.mkstemp(prefix="cortex-redis-", suffix=".log")
            os.close(fd)
            argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--loglevel", "warning", "--logfile", redis_log]
            try:
                child = sup.start("redis", argv, env)
            except FileNotFoundError:
                log("redis-server is not on PATH: install it (apt-get install redis-server) or set CORTEX_REDIS_URL")
                return 2
            if not _wait_for_redis(redis_url, child):
                log(f"redis-server did not start; its log ({redis_log}) ends:\n{_tail(redis_log)}")
                redis_log = None
                return 1
            log(f"redis-server on {redis_url} (pid {child.proc.pid}, no persistence)")
        env["CORTEX_REDIS_URL"] = redis_url

        gateway_env = env | {"CORTEX_HOST": gateway_settings.host, "CORTEX_PORT": str(gateway_settings.port)}
        child = sup.start("gateway", [sys.executable, "-m", "gateway"], gateway_env)
        log(f"gateway starting (pid {child.proc.pid}) on http://{gateway_settings.host}:{gateway_settings.port}")
        child = sup.start("batch-worker", [sys.executable, "-m", "gateway.batch"], env)
        log(f"batch worker starting (pid {child.proc.pid}) for /v1/batches")
        node_env = env | {"CORTEX_MODELS": json.dumps(node_settings.models)}
        # The node finishes running jobs for up to its shutdown_grace_s before it exits.
        node_timeout_s = args.stop_timeout_s if args.stop_timeout_s is not None else node_settings.shutdown_grace_s + 10
        child = sup.start("node", [sys.executable, "-m", "node_agent"], node_env, node_timeout_s)
        log(f"node agent starting (pid {child.proc.pid}) with {', '.join(node_settings.models)}; loading takes a while")

        watch = ReadinessWatch(redis_url, gateway_settings.keys, f"http://{_connect_host(gateway_settings.host)}:{gateway_settings.port}",
                               node_settings.models)
        next_poll = 0.0
        while not sup.signals:
            dead = sup.first_dead()
            if dead is not None:
                log(f"{dead.name} exited with code {dead.proc.returncode}; stopping the rest")
                if dead.name == "redis" and redis_log:
                    log(f"its log ({redis_log}) ends:\n{_tail(redis_log)}")
                    redis_log = None
                exit_code = 1
                break
            if not watch.announced and time.monotonic() >= next_poll:
                watch.poll(log)
                next_poll = time.monotonic() + 0.5
            time.sleep(0.1)
        if sup.signals:
            log("stopping (Ctrl-C again to kill at once)")
    finally:
        sup.stop_all(log)
        if redis_log:
            Path(redis_log).unlink(missing_ok=True)
    log("all stopped")
    return exit_code


def _tail(path: str, lines: int = 10) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def _overrides(args: argparse.Namespace, **names: str) -> dict[str, Any]:
    """Settings keyword arguments for the flags that were given (None means not given)."""
    return {setting: getattr(args, flag) for setting, flag in names.items() if getattr(args, flag, None) is not None}


def _apply_common(args: argparse.Namespace) -> None:
    if getattr(args, "config", None):
        os.environ["CORTEX_CONFIG"] = str(args.config)
    if getattr(args, "redis_url", None):
        os.environ["CORTEX_REDIS_URL"] = args.redis_url


def cmd_gateway(args: argparse.Namespace) -> int:
    settings = GatewaySettings(**_overrides(args, host="host", port="port"))
    from gateway.server import run

    run(settings)
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    settings = NodeSettings(**_overrides(args, models="models", node_name="node_name", device="device"))
    from node_agent.agent import run

    run(settings)
    return 0


def cmd_batch_worker(args: argparse.Namespace) -> int:
    from gateway.batch.worker import run
    from shared.settings import BatchSettings

    run(BatchSettings())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    settings = GatewaySettings()
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=5)
    try:
        fleet = read_fleet(client, settings.keys, node_ttl_s=settings.node_ttl_s)
    except redis.RedisError as exc:
        print(f"cortex status: cannot read Redis at {redact(settings.redis_url)}: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
    if args.json:
        print(fleet.model_dump_json(indent=2))
    else:
        render_fleet(fleet)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    return asyncio.run(_operate(args.action, args.model, args.node))


def cmd_drain(args: argparse.Namespace) -> int:
    return asyncio.run(_operate("drain", None, args.node))


async def _operate(action: str, model: str | None, node: str | None) -> int:
    """Run one fleet operation straight against Redis, as a gateway would."""
    from gateway import operations
    from gateway.context import GatewayContext
    from gateway.fleet import Fleet
    from shared.catalog import Catalog
    from shared.errors import CortexError
    from shared.redis_conn import connect

    settings = GatewaySettings()
    client = connect(settings.redis_url)
    ctx = GatewayContext(settings, settings.keys, client, Catalog.load(settings.models_file), None,
                         Fleet(client, settings.keys, settings.node_ttl_s))
    try:
        if action == "load":
            print(f"loading {model} on {await operations.load(ctx, model, node)}")
        elif action == "unload":
            print(f"unloading {model} from {', '.join(await operations.unload(ctx, model, node)) or 'no node'}")
        elif action in ("pin", "unpin"):
            await operations.set_pin(ctx, model, action == "pin")
            print(f"{model} {action}ned")
        else:
            await operations.drain(ctx, node)
            print(f"draining {node}: it finishes its running jobs, unloads its models and goes idle")
        return 0
    except (CortexError, redis.RedisError) as exc:
        print(f"cortex {action}: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    finally:
        await client.aclose()


def cmd_keys(args: argparse.Namespace) -> int:
    return asyncio.run(_keys(args))


async def _keys(args: argparse.Namespace) -> int:
    """`cortex keys create | list | show | revoke`, straight against Redis, as `/admin/keys` would."""
    from shared.api_keys import KeySpec, KeyStore
    from shared.errors import CortexError
    from shared.redis_conn import connect

    settings = GatewaySettings()
    client = connect(settings.redis_url)
    store = KeyStore(client, settings.keys)
    try:
        if args.action == "create":
            spec = KeySpec(name=args.name, models=args.models or [], rpm=args.rpm, tpm=args.tpm,
                           max_tokens_per_day=args.max_tokens_per_day, expires=args.expires)
            key, secret = await store.create(spec)
            print(secret)
            print(f"created API key {key.name}: {_key_summary(key.shown())}\nthe secret above is shown only now "
                  "(Redis keeps its hash): clients send it as Authorization: Bearer or x-api-key", file=sys.stderr)
        elif args.action == "list":
            shown = [key.shown() for key in await store.list()]
            if args.json:
                print(json.dumps(shown, indent=2))
            else:
                render_keys(shown)
        elif args.action == "show":
            shown = (await store.get(args.name)).shown()
            print(json.dumps(shown, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in shown.items()))
        else:
            print(f"revoked API key {(await store.revoke(args.name)).name}: every gateway refuses it from now on")
        return 0
    except ValidationError as exc:
        print(f"cortex keys {args.action}: " + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                                        for e in exc.errors()), file=sys.stderr)
    except (CortexError, redis.RedisError) as exc:
        print(f"cortex keys {args.action}: {getattr(exc, 'message', exc)}", file=sys.stderr)
    finally:
        await client.aclose()
    return 2


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ms / 1000)) if ms else "never"


def _key_summary(k: dict) -> str:
    limit = lambda n: str(n) if n else "-"
    return (f"models {','.join(k['models']) or 'all'}; rpm {limit(k['rpm'])}, tpm {limit(k['tpm'])}, "
            f"tokens/day {limit(k['max_tokens_per_day'])}; expires {_when(k['expires_ms'])}")


def render_keys(keys: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)  # pipes get whole rows
    if not keys:
        console.print("No API keys: auth is off on loopback gateways. Create one with `cortex keys create --name NAME`.")
        return
    table = Table(title="API keys", title_justify="left")
    for column in ("name", "key", "state", "models", "rpm/tpm/day", "expires", "requests", "tokens in/out", "today",
                   "refused"):
        numeric = column in ("requests", "tokens in/out", "today", "refused")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=column in ("name", "key"))
    limit = lambda n: str(n) if n else "-"
    for k in keys:
        table.add_row(k["name"], k["hint"] + "…", k["state"], ",".join(k["models"]) or "all",
                      "/".join(limit(k[f]) for f in ("rpm", "tpm", "max_tokens_per_day")), _when(k["expires_ms"]),
                      str(k["requests"]), f"{k['prompt_tokens']}/{k['completion_tokens']}", str(k["tokens_today"]),
                      str(k["rejections"]))
    console.print(table)


def _count_arg(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError("a whole number, 0 or more (0: no limit)")
    return int(value)


def _models_arg(value: str) -> list[str]:
    models = [m.strip() for m in value.split(",") if m.strip()]
    if not models:
        raise argparse.ArgumentTypeError("name at least one model")
    return models


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=CLI_NAME, description="Cortex: local LLMs served across a fleet, with Redis as the spine.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="TOML settings file with [gateway] and [node] tables (sets CORTEX_CONFIG)")
    common.add_argument("--redis-url", help="Redis to use (sets CORTEX_REDIS_URL)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("gateway", parents=[common], help="run one gateway (HTTP API)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("node", parents=[common], help="run one node agent")
    p.add_argument("--models", type=_models_arg, help="comma-separated catalogue ids to load at start")
    p.add_argument("--node-name")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    p.set_defaults(func=cmd_node)

    p = sub.add_parser("batch-worker", parents=[common], help="run one batch worker (arq) for /v1/batches")
    p.set_defaults(func=cmd_batch_worker)

    p = sub.add_parser("up", parents=[common], help="run redis-server, a gateway and a node agent together, in the foreground")
    p.add_argument("--host", help="gateway host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gateway port (default 31313)")
    p.add_argument("--models", type=_models_arg, help="comma-separated catalogue ids the node loads")
    p.add_argument("--redis-port", type=int, default=int(os.environ.get("CORTEX_UP_REDIS_PORT", UP_REDIS_PORT)),
                   help="port of the embedded redis-server (CORTEX_UP_REDIS_PORT, default %(default)s); "
                        "ignored when CORTEX_REDIS_URL is set")
    p.add_argument("--stop-timeout-s", type=float,
                   help="how long each child may take to stop before it is killed (default: the node's "
                        "shutdown_grace_s + 10, 10 for the others); a second Ctrl-C kills at once")
    p.set_defaults(func=run_up)

    p = sub.add_parser("models", parents=[common], help="load, unload, pin or unpin a model across the fleet")
    p.add_argument("action", choices=["load", "unload", "pin", "unpin"])
    p.add_argument("model", help="catalogue id or alias")
    p.add_argument("--node", help="load on / unload from this node only (default: placement decides / every node)")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("drain", parents=[common], help="stop a node taking jobs; it finishes running ones, unloads, idles")
    p.add_argument("node")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("keys", help="create, list, show or revoke API keys (in Redis)")
    keys = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    k = keys.add_parser("create", parents=[common], help="create a key; prints its secret once")
    k.add_argument("--name", required=True, help="unique; names the key in logs, metrics and ownership")
    k.add_argument("--models", type=_models_arg, help="comma-separated catalogue ids or aliases (default: all)")
    k.add_argument("--rpm", type=_count_arg, default=0, help="requests per minute (0: no limit)")
    k.add_argument("--tpm", type=_count_arg, default=0, help="tokens (prompt + completion) per minute (0: no limit)")
    k.add_argument("--max-tokens-per-day", type=_count_arg, default=0, help="tokens per UTC day (0: no limit)")
    k.add_argument("--expires", help="lifetime from now: 30d, 12h, 90m (default: never)")
    k = keys.add_parser("list", parents=[common], help="every key with its limits and usage")
    k.add_argument("--json", action="store_true")
    k = keys.add_parser("show", parents=[common], help="one key with its limits and usage")
    k.add_argument("name")
    k.add_argument("--json", action="store_true")
    k = keys.add_parser("revoke", parents=[common], help="refuse a key from now on (its record and usage stay)")
    k.add_argument("name")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("status", parents=[common], help="show nodes, devices, models, slots and queues")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _apply_common(args)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
