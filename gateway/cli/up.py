"""`cortex up` (what `scripts/serve` runs): a private, durable redis-server (unless `CORTEX_REDIS_URL`
names one; gateway/cli/embedded_redis.py), a gateway, a batch worker and one node agent, each a
process (`python -m gateway`, `python -m gateway.batch`, `python -m node_agent`) under
`shared.processes.Supervisor`, in the foreground. It says when the gateway answers and each model is
ready, leaves a run file so that other `cortex` verbs find this Redis, starts Redis again if it dies
(the other parts reconnect), and on Ctrl-C stops everything and removes the run file."""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from redis.exceptions import RedisError

from gateway.cli.embedded_redis import DataDirBusy, EmbeddedRedis
from gateway.cli.run_file import RunFile
from shared import processes
from shared.fleet import Fleet
from shared.keys import Keys
from shared.lifecycle import ModelState
from shared.redis_conn import connect, redact
from shared.settings import GatewaySettings, NodeSettings

UP_REDIS_PORT = 31379
REDIS_STOP_TIMEOUT_S = 60.0
REDIS_RESTARTS, REDIS_RESTART_WINDOW_S = (
    3,
    60.0,
)  # more restarts of Redis than this within the window: a crash loop


async def read_models(redis_url: str, keys: Keys) -> list[tuple[str, str, str, bool, str]]:
    """(node, model, state, node alive, error) for every model on every node."""
    client = connect(redis_url)
    try:
        fleet = await Fleet(client, keys, node_ttl_s=8.0).status()
    finally:
        await client.aclose()
    return [
        (n.node, name, m.state, n.alive, m.error)
        for n in fleet.nodes
        for name, m in n.models.items()
    ]


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
            try:
                self.gateway_up = (
                    httpx.get(self.base_url + "/health", timeout=0.5).status_code < 500
                )
                if self.gateway_up:
                    log(f"gateway answers on {self.base_url}")
            except httpx.HTTPError:
                pass
        try:
            models = asyncio.run(read_models(self.redis_url, self.keys))
        except (RedisError, OSError):
            return
        ready = set()
        for node, name, state, alive, error in models:
            if self.states.get((node, name)) != state:
                self.states[(node, name)] = state
                took = time.monotonic() - self.started
                log(
                    f"model {name} is {state} on node {node} ({took:.1f}s)"
                    + (f": {error}" if error else "")
                )
            if state == ModelState.READY and alive:
                ready.add(name)
        if (
            self.gateway_up
            and not self.announced
            and (ready >= set(self.models) if self.models else ready)
        ):
            self.announced = True
            log(
                f"ready: OpenAI-compatible API at {self.base_url}/v1 serving {', '.join(sorted(ready))}; "
                "Ctrl-C stops everything"
            )


def _tail(path: str, lines: int = 10) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _start_redis(
    sup: processes.Supervisor,
    embedded: EmbeddedRedis,
    env: dict[str, str],
    log,
    stop_timeout_s: float,
):
    """Start the embedded redis-server and wait until it answers (a restored snapshot is loaded,
    then written to the append-only file); None, having said why, if it cannot."""
    restoring = embedded.restoring()
    if restoring:
        log(
            f"{embedded.data_dir} holds a snapshot and no append-only file: loading the snapshot, then "
            "writing the append-only file"
        )
    try:
        child = sup.start("redis", embedded.argv(), env, stop_timeout_s=stop_timeout_s)
    except FileNotFoundError:
        log(
            "redis-server is not on PATH: install it (apt-get install redis-server) or set CORTEX_REDIS_URL"
        )
        return None
    if not processes.wait_for_redis(embedded.url, child, timeout_s=300 if restoring else 15):
        log(
            f"redis-server did not start; its log ({embedded.logfile}) ends:\n{_tail(embedded.logfile)}"
        )
        return None
    if restoring:
        try:
            embedded.turn_aof_on()
        except (RedisError, TimeoutError) as exc:
            log(
                f"could not turn the append-only file on: {exc}; its log ({embedded.logfile}) ends:\n"
                f"{_tail(embedded.logfile)}"
            )
            return None
    return child


def run_up(
    args: argparse.Namespace, gateway_settings: GatewaySettings, node_settings: NodeSettings
) -> int:
    def log(message: str) -> None:
        print(f"[cortex up] {message}", flush=True)

    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not processes.port_free(gateway_settings.host, gateway_settings.port):
        log(
            f"port {gateway_settings.port} on {gateway_settings.host} is already in use (another `cortex up`?); "
            "stop it or set CORTEX_PORT / --port"
        )
        return 2

    sup = processes.Supervisor(
        stop_timeout_s=args.stop_timeout_s if args.stop_timeout_s is not None else 10.0
    )
    sup.install_signal_handlers()
    exit_code = 0
    redis_log: str | None = None  # the embedded redis-server's log, removed unless it failed
    run_file: RunFile | None = None
    try:
        external = os.environ.get("CORTEX_REDIS_URL")
        if external:
            redis_url = external
            log(f"using Redis at {redact(redis_url)}")
            if not processes.wait_for_redis(redis_url, None, timeout_s=5):
                log(f"Redis at {redact(redis_url)} does not answer PING")
                return 2
        else:
            port = args.redis_port
            if not processes.port_free("127.0.0.1", port):
                log(
                    f"port {port} for the embedded Redis is in use; set CORTEX_UP_REDIS_PORT, or CORTEX_REDIS_URL to use that Redis"
                )
                return 2
            fd, redis_log = tempfile.mkstemp(prefix="cortex-redis-", suffix=".log")
            os.close(fd)
            embedded = EmbeddedRedis(
                port, Path(args.redis_dir) if args.redis_persistence else None, redis_log
            )
            try:
                embedded.hold_data_dir()
            except (DataDirBusy, OSError) as exc:
                log(f"cannot use the Redis data directory: {exc}")
                return 2
            redis_url = embedded.url
            # on SIGTERM Redis fsyncs its file, then writes a last snapshot: ~10 s for 1 GiB
            child = _start_redis(
                sup,
                embedded,
                env,
                log,
                args.stop_timeout_s if args.stop_timeout_s is not None else REDIS_STOP_TIMEOUT_S,
            )
            if child is None:
                redis_log = None
                return 1
            log(f"redis-server on {redis_url} (pid {child.proc.pid}, {embedded.describe()})")
        env["CORTEX_REDIS_URL"] = redis_url

        gateway_env = env | {
            "CORTEX_HOST": gateway_settings.host,
            "CORTEX_PORT": str(gateway_settings.port),
        }
        child = sup.start("gateway", [sys.executable, "-m", "gateway"], gateway_env)
        log(
            f"gateway starting (pid {child.proc.pid}) on http://{gateway_settings.host}:{gateway_settings.port}"
        )
        child = sup.start("batch-worker", [sys.executable, "-m", "gateway.batch"], env)
        log(
            f"batch worker starting (pid {child.proc.pid}) for /v1/batches and /v1/messages/batches"
        )
        node_env = env | {"CORTEX_MODELS": json.dumps(node_settings.models)}
        # The node finishes running jobs for up to its shutdown_grace_s before it exits.
        node_timeout_s = (
            args.stop_timeout_s
            if args.stop_timeout_s is not None
            else node_settings.shutdown_grace_s + 10
        )
        child = sup.start(
            "node", [sys.executable, "-m", "node_agent"], node_env, stop_timeout_s=node_timeout_s
        )
        log(
            f"node agent starting (pid {child.proc.pid}) with {', '.join(node_settings.models)}; loading takes a while"
        )

        base_url = f"http://{_connect_host(gateway_settings.host)}:{gateway_settings.port}"
        run_file = RunFile(pid=os.getpid(), redis_url=redis_url, gateway_url=base_url)
        log(f"`cortex status` and the other verbs find this stack through {run_file.write()}")
        watch = ReadinessWatch(redis_url, gateway_settings.keys, base_url, node_settings.models)
        next_poll = 0.0
        redis_restarts: list[float] = []  # when the embedded Redis was started again
        while not sup.signals:
            dead = sup.first_dead()
            recent = [t for t in redis_restarts if time.monotonic() - t < REDIS_RESTART_WINDOW_S]
            if dead is not None and dead.name == "redis" and len(recent) < REDIS_RESTARTS:
                log(
                    f"redis-server exited with code {dead.proc.returncode}; its log ({redis_log}) ends:\n"
                    f"{_tail(redis_log)}\nstarting it again (the other parts reconnect)"
                )
                child = sup.restart(dead, embedded.argv())
                redis_restarts = recent + [time.monotonic()]
                if processes.wait_for_redis(redis_url, child, timeout_s=60):
                    log(f"redis-server is back on {redis_url} (pid {child.proc.pid})")
                continue
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
        if run_file is not None:
            run_file.remove()
        sup.stop_all(log)
        if redis_log:
            Path(redis_log).unlink(missing_ok=True)
    log("all stopped")
    return exit_code
