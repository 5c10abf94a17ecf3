"""Fixtures shared by every tier: real processes on free loopback ports.

- `redis_server` (session): a real `redis-server` without persistence; yields its URL.
- `redis_url` (function): the same server, flushed before the test.
- `gateway_env` (function): extra environment for the gateway; override it in a module or a
  conftest next to your tests to configure the gateway (e.g. `CORTEX_MODELS_FILE`).
- `gateway_url` (function): `python -m gateway` on a free port against `redis_url`; yields
  its base URL (`http://127.0.0.1:P`) once `/health` answers 200.
- `wait_until(ready, timeout_s, what)` / `await eventually(predicate, timeout_s, what)`: wait on a
  condition (the second from a coroutine; its predicate may be async), never for a fixed time.
- `spans` (function): tracing on in this process (shared/tracing.py), every span kept in memory;
  yields the OpenTelemetry SDK's in-memory exporter.

Process fixtures for other parts (a node agent, say) belong next to these and can reuse
`free_port`, `wait_until` and `Service`.
"""

import asyncio
import inspect
import os
import shutil
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from shared import processes, tracing
from shared.processes import free_port, redis_answers

pytest_plugins = ["tests.model_fixtures"]

# Nodes started by tests decode eagerly: with a compile cache each tiny full-precision model would
# compile its decode step at load (15-40 s on a 2-core host). The compiled step has its own tests:
# the architecture matrix's "compiled" mode and tests/model/test_compiled_restart.py.
os.environ.setdefault("CORTEX_COMPILE_CACHE", "")

START_TIMEOUT_S = 20.0


def wait_until(
    ready: Callable[[], bool],
    timeout_s: float,
    what: str,
    *,
    alive: Callable[[], bool] = lambda: True,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{what} exited while starting")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout_s:g}s")


async def eventually(
    predicate: Callable[[], object], timeout_s: float = 5.0, what: str = "condition"
) -> None:
    """Until `predicate()` (or what it awaits to) is true; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await _value(predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not so after {timeout_s:g}s")
        await asyncio.sleep(0.01)


async def _value(result: object) -> object:
    return await result if inspect.isawaitable(result) else result


class Service:
    """A child process (started by shared.processes, like every part Cortex starts) with its output
    in a log file; `stop()` terminates it (then kills)."""

    def __init__(
        self,
        name: str,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ):
        self.name, self.log_path = name, log_path
        self.child = processes.start(name, args, env, log_path=log_path, cwd=cwd)
        self.proc = self.child.proc

    def alive(self) -> bool:
        return self.child.alive()

    def log_tail(self, chars: int = 4000) -> str:
        return self.child.log_tail(chars)

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float = START_TIMEOUT_S) -> None:
        try:
            wait_until(ready, timeout_s, self.name, alive=self.alive)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"{exc}; its log ends:\n{self.log_tail()}") from None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        return self.child.stop(timeout_s)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except OSError:  # URLError and HTTPError are OSErrors
        return False


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (scripts/test installs it)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    server = Service(
        "redis-server", processes.redis_server_argv(port, workdir=workdir), workdir / "redis.log"
    )
    url = f"redis://127.0.0.1:{port}/0"
    server.wait_ready(lambda: redis_answers(url))
    yield url
    server.stop()


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    yield redis_server


@pytest.fixture
def spans():
    # the SDK is imported here: a GPU host's offline bundle (../shared/gpu/offline-bundle) has only the API
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.install(None)
    provider.shutdown()


@pytest.fixture
def gateway_env() -> dict[str, str]:
    return {}


@pytest.fixture
def gateway_url(redis_url: str, gateway_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = (
        os.environ
        | {
            "CORTEX_REDIS_URL": redis_url,
            "CORTEX_HOST": "127.0.0.1",
            "CORTEX_PORT": str(port),
            "CORTEX_LOG_LEVEL": "INFO",
        }
        | gateway_env
    )
    gateway = Service(
        "gateway", [sys.executable, "-m", "gateway"], tmp_path / "gateway.log", env=env
    )
    url = f"http://127.0.0.1:{port}"
    gateway.wait_ready(lambda: _http_ok(f"{url}/health"))
    yield url
    gateway.stop()


# Every test carries the marker of its tier, from where it lives (a file need not say it):
# `scripts/test --quick` runs `-m quick`: the unit tier without the modules below and without the
# unit tests marked `slow` one by one (a whole step compiled, a fresh process's peak memory, a
# default-model load, thousands of samples); the full run has them all.
TIERS = {"tests/integration/": "integration", "tests/model/": "model", "tests/gpu/": "gpu"}
SLOW_UNIT_MODULES = {
    "test_architectures.py",
    "test_vision.py",
    "test_cpu_attention.py",  # the architecture matrix
    "test_quantized_matrix.py",
    "test_tensor_parallel.py",
    "test_quantized_tensor_parallel.py",
}  # ranks in processes (gloo)


def pytest_addoption(parser):
    parser.addoption(
        "--soak-s",
        type=float,
        default=0.0,
        help="run the fleet soak (tests/integration/fleet/test_soak.py) at least this long; "
        "0: each fault once",
    )


def pytest_collection_modifyitems(config, items):
    soak_s = config.getoption("--soak-s")
    for item in items:
        if soak_s and item.get_closest_marker("timeout") and "test_soak" in item.nodeid:
            item.add_marker(
                pytest.mark.timeout(600 + 2 * soak_s), append=False
            )  # the longer soak's own limit
        path = Path(str(item.fspath)).as_posix()
        tier = next((mark for folder, mark in TIERS.items() if f"/{folder}" in path), None)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
        elif Path(path).name in SLOW_UNIT_MODULES or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        else:
            item.add_marker(pytest.mark.quick)
