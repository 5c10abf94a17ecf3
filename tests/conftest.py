"""Fixtures shared by every tier: real processes on free loopback ports.

- `redis_server` (session): a real `redis-server` without persistence; yields its URL.
- `redis_url` (function): the same server, flushed before the test.
- `gateway_env` (function): extra environment for the gateway; override it in a module or a
  conftest next to your tests to configure the gateway (e.g. `CORTEX_MODELS_FILE`).
- `gateway_url` (function): `python -m gateway` on a free port against `redis_url`; yields
  its base URL (`http://127.0.0.1:P`) once `/health` answers 200.

Process fixtures for other parts (a node agent, say) belong next to these and can reuse
`free_port`, `wait_until` and `Service`.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests.model_fixtures"]
import redis

START_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str, *, alive: Callable[[], bool] = lambda: True) -> None:
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


class Service:
    """A child process with its output in a log file; `stop()` terminates it (then kills)."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float = START_TIMEOUT_S) -> None:
        try:
            wait_until(ready, timeout_s, self.name, alive=self.alive)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"{exc}; its log ends:\n{self.log_tail()}") from None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _redis_pings(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except OSError:  # URLError and HTTPError are OSErrors
        return False


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not on PATH (scripts/test installs it)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)]
    server = Service("redis-server", args, workdir / "redis.log")
    url = f"redis://127.0.0.1:{port}/0"
    server.wait_ready(lambda: _redis_pings(url))
    yield url
    server.stop()


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    yield redis_server


@pytest.fixture
def gateway_env() -> dict[str, str]:
    return {}


@pytest.fixture
def gateway_url(redis_url: str, gateway_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = os.environ | {
        "CORTEX_REDIS_URL": redis_url,
        "CORTEX_HOST": "127.0.0.1",
        "CORTEX_PORT": str(port),
        "CORTEX_LOG_LEVEL": "INFO",
    } | gateway_env
    gateway = Service("gateway", [sys.executable, "-m", "gateway"], tmp_path / "gateway.log", env=env)
    url = f"http://127.0.0.1:{port}"
    gateway.wait_ready(lambda: _http_ok(f"{url}/health"))
    yield url
    gateway.stop()
