"""Each unit's ExecStart, run as systemd would run it but without systemd: the command line parsed
from the unit, its Environment= and EnvironmentFile= (a node instance's /etc/cortex/node-t1.env),
its WorkingDirectory, and the shipped /etc/cortex/cortex.toml, with /etc/cortex, /var/lib/cortex
and /var/cache/cortex redirected into a folder of the test's and /opt/cortex/venv standing for this
virtual environment. A datagram socket stands in for systemd's notify socket: the node says
READY=1 once its start-up model is loaded (its heartbeat says so by then), the gateway once it
serves; the stack serves a chat completion; SIGTERM (KillSignal=) stops each within its
TimeoutStopSec, exit code 0, the node saying STOPPING=1 first."""

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from torch.utils import cpp_extension

from shared.keys import Keys
from shared.processes import free_port
from tests.conftest import Service, wait_until
from tests.integration.fleet.conftest import catalogue
from tests.systemd_units import PACKAGING, ROOT, UNITS_DIR, Unit, environment_file, load

MODEL = "tiny"
INSTANCE = "t1"
HOST_FOLDERS = ("/etc/cortex", "/var/lib/cortex", "/var/cache/cortex")
VENV_BIN = "/opt/cortex/venv/bin/"
# its first CPU load builds the node's C++ kernels in the unit's own cache (/var/cache/cortex): 120 s
# ran out on a 2-core AVX2 EPYC while another test ran beside it
NODE_READY_TIMEOUT_S = 240.0
# What systemd counts as a clean stop of a service's main process: exit 0, or death by SIGTERM (uvicorn
# re-raises the signal it handled once its shutdown is done); a SIGKILL after TimeoutStopSec is not.
CLEAN_EXITS = (0, -signal.SIGTERM)


class Host:
    """A folder standing for a host the packages were installed on, its gateway's port and Redis."""

    def __init__(self, root: Path, port: int, redis_url: str):
        self.root, self.port, self.redis_url = root, port, redis_url
        for folder in HOST_FOLDERS:
            self.path(folder).mkdir(parents=True)

    def path(self, path: str) -> Path:
        return Path(self.redirect(path))

    def redirect(self, text: str) -> str:
        """`text` with the host's folders moved under the test's root, the venv this one."""
        for folder in HOST_FOLDERS:
            text = text.replace(folder, str(self.root) + folder)
        return text.replace(VENV_BIN, str(Path(sys.executable).parent) + "/")


class NotifySocket:
    """What systemd listens on for a Type=notify unit's messages ($NOTIFY_SOCKET)."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.heard: list[str] = []

    def wait_for(self, state: str, service: Service, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self.sock.settimeout(0.2)
        while not any(state in message.split("\n") for message in self.heard):
            try:
                self.heard.append(self.sock.recv(4096).decode())
                continue  # what it sent before it exited is still there to read
            except TimeoutError:
                pass
            if time.monotonic() > deadline or not service.alive():
                raise AssertionError(
                    f"{service.name} did not send {state} (heard {self.heard}); its log ends:\n"
                    + service.log_tail()
                )

    def close(self) -> None:
        self.sock.close()


def start_unit(host: Host, name: str, notify: NotifySocket | None = None) -> tuple[Service, Unit]:
    """The unit's ExecStart as systemd would start it: its environment (systemd's own few
    variables, the user's HOME, then the unit's), its working directory; PYTHONPATH puts this
    checkout where the venv's wheel would be."""
    unit = load(UNITS_DIR / name, INSTANCE)
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "HOME": str(host.path("/var/lib/cortex"))}
    env |= {
        key: host.redirect(value)
        for key, value in unit.environment(lambda path: host.path(path).read_text()).items()
    }
    env["PYTHONPATH"] = str(ROOT)
    if notify is not None:
        env["NOTIFY_SOCKET"] = notify.path
    argv = [host.redirect(word) for word in unit.exec_start()]
    log = host.root / f"{name}.log"
    return Service(name, argv, log, env=env, cwd=host.path(unit.value("WorkingDirectory"))), unit


def stop_timeout_s(unit: Unit) -> float:
    return float(unit.value("TimeoutStopSec").removesuffix("s"))


@pytest.fixture
def host(tmp_path, small_vocab_dirs, redis_url) -> Host:
    """/etc/cortex as shipped, but for the Redis, the port and the catalogue of this test, and a
    node instance `t1` with its own settings file (the tiny model; eager decoding and one torch
    thread, as every test node)."""
    host = Host(tmp_path / "host", free_port(), redis_url)
    config = host.redirect((PACKAGING / "cortex.toml").read_text())
    config = re.sub(r"^redis_url = .*$", f'redis_url = "{redis_url}"', config, flags=re.M)
    config = re.sub(r"^port = 31313$", f"port = {host.port}", config, flags=re.M)
    host.path("/etc/cortex/cortex.toml").write_text(config)
    host.path("/etc/cortex/models.toml").write_text(catalogue(small_vocab_dirs["llama"], tiny={}))
    # the CPU attention kernel is built once per machine, not per test (~25 s; as other tests find it)
    node_env = (
        f'CORTEX_MODELS=["{MODEL}"]\nCORTEX_TORCH_THREADS=1\nCORTEX_COMPILE_CACHE=\n'
        "TORCH_EXTENSIONS_DIR="
        + (os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
        + "\n"
    )
    host.path(f"/etc/cortex/node-{INSTANCE}.env").write_text(node_env)
    env = environment_file(node_env)
    assert env["CORTEX_MODELS"] == '["tiny"]'  # systemd keeps quotes inside a value
    assert env["CORTEX_COMPILE_CACHE"] == ""  # empty: decode eagerly
    return host


@pytest.mark.timeout(420)
def test_units_start_serve_and_stop_as_systemd_would_run_them(tmp_path, host):
    node_notify = NotifySocket(tmp_path / "notify-node")
    gateway_notify = NotifySocket(tmp_path / "notify-gateway")
    batch_notify = NotifySocket(tmp_path / "notify-batch")
    services: list[tuple[Service, Unit]] = []
    try:
        services.append(start_unit(host, "cortex-node@.service", node_notify))
        services.append(start_unit(host, "cortex-gateway.service", gateway_notify))
        services.append(start_unit(host, "cortex-batch.service", batch_notify))
        (node, _), (gateway, _), (batch, _) = services

        gateway_notify.wait_for("READY=1", gateway, 60)
        node_notify.wait_for("READY=1", node, NODE_READY_TIMEOUT_S)
        name = f"{socket.gethostname()}-{INSTANCE}"  # Environment=CORTEX_NODE_NAME=%H-%i
        heartbeat = redis.Redis.from_url(host.redis_url).hget(Keys().node(name), "models")
        assert json.loads(heartbeat)[MODEL]["state"] == "ready"  # loaded before READY=1

        batch_notify.wait_for("READY=1", batch, 30)
        assert host.redis_url in batch.log_tail()  # from cortex.toml, as the others
        base = f"http://127.0.0.1:{host.port}"
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, 10, "the gateway")
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] > 0

        for service, unit in reversed(services):  # KillSignal=SIGTERM, then TimeoutStopSec
            code = service.stop(stop_timeout_s(unit))
            assert code in CLEAN_EXITS, (
                f"{service.name} exited {code}; its log ends:\n{service.log_tail()}"
            )
        node_notify.wait_for("STOPPING=1", node, 0)
    finally:
        for service, _ in services:
            service.stop()
        node_notify.close()
        gateway_notify.close()
        batch_notify.close()
