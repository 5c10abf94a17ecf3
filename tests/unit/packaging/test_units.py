"""The systemd units under packaging/systemd: `systemd-analyze verify` passes on each (and on the
Redis drop-in over Debian's Redis unit), `systemd-analyze security` scores each "OK" or better,
and each has what the issue asks of it (the system user, restart on failure, the sandbox with
only the state and cache folders writable, the journal, the config file); the Redis settings file
loads into a real redis-server."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import redis

from shared.processes import free_port, redis_answers
from tests.conftest import Service
from tests.systemd_units import (
    PACKAGING,
    REDIS_DROP_IN,
    SERVICES,
    UNITS_DIR,
    instance_name,
    load,
)

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)"
)
HOST_UNITS = Path("/usr/lib/systemd/system")
# Debian's own redis-server.service ExecStart, for hosts without it (the drop-in replaces it)
REDIS_UNIT_STAND_IN = (
    "[Unit]\nDescription=Advanced key-value store\n[Service]\nType=notify\n"
    "ExecStart=/usr/bin/redis-server /etc/redis/redis.conf --supervised systemd --daemonize no\n"
    "User=redis\n[Install]\nWantedBy=multi-user.target\n"
)
STATE_FOLDERS = {"/var/lib/cortex", "/var/cache/cortex"}
# systemd-analyze security's bands (src/analyze/analyze-security.c): below 5.0 is "OK" or better
OK_EXPOSURE = 5.0


def executable(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A root as a host with the packages installed has it: systemd's own units (copied from this
    machine), the units and the drop-in where the packages put them, and the programs they run
    (stand-ins: verify checks that each ExecStart names an executable)."""
    if ANALYZE is None or not HOST_UNITS.is_dir():
        pytest.skip(
            "systemd-analyze or systemd's units are not installed (apt-get install systemd)"
        )
    root = tmp_path_factory.mktemp("root")
    units = root / "usr/lib/systemd/system"
    shutil.copytree(HOST_UNITS, units, symlinks=True)
    for service in SERVICES:
        shutil.copy(UNITS_DIR / service, units / service)
    if not (units / "redis-server.service").exists():
        (units / "redis-server.service").write_text(REDIS_UNIT_STAND_IN)
    (units / "redis-server.service.d").mkdir(exist_ok=True)
    shutil.copy(REDIS_DROP_IN, units / "redis-server.service.d" / "cortex.conf")
    executable(root / "opt/cortex/venv/bin/cortex")
    executable(root / "usr/bin/redis-server")
    return root


@needs_analyze
@pytest.mark.parametrize("unit", [*SERVICES, "redis-server.service"])
def test_systemd_analyze_verify_passes_without_a_warning(root, unit):
    done = subprocess.run(
        [ANALYZE, "verify", f"--root={root}", instance_name(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), (
        done.stdout + done.stderr
    )


@needs_analyze
def test_verify_would_complain_of_a_mistake(root, tmp_path):
    """The test above can fail: an unknown key is a warning, a missing program an error."""
    units = root / "usr/lib/systemd/system"
    broken = (
        (UNITS_DIR / "cortex-batch.service")
        .read_text()
        .replace("Restart=on-failure", "Restart=on-failure\nRestartt=always")
    )
    (units / "cortex-broken.service").write_text(broken.replace("/opt/cortex", "/opt/nowhere"))
    done = subprocess.run(
        [ANALYZE, "verify", f"--root={root}", "cortex-broken.service"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Unknown key 'Restartt'" in done.stderr
    assert done.returncode != 0 and "/opt/nowhere/venv/bin/cortex" in done.stderr


@needs_analyze
@pytest.mark.parametrize("unit", SERVICES)
def test_systemd_analyze_security_scores_ok_or_better(root, unit):
    done = subprocess.run(
        [ANALYZE, "security", "--offline=true", f"--root={root}", instance_name(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "--offline" in done.stderr:  # systemd older than 250
        pytest.skip(f"this systemd-analyze has no --offline: {done.stderr.strip()}")
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d) (\w+)", done.stdout)
    assert found, done.stdout + done.stderr
    exposure, band = float(found[1]), found[2]
    assert exposure < OK_EXPOSURE and band in ("OK", "SAFE", "PERFECT"), found[0]


@pytest.mark.parametrize("service", SERVICES)
def test_each_unit_runs_sandboxed_as_the_cortex_user_from_the_config_file(service):
    unit = load(UNITS_DIR / service, "t1")
    assert unit.exec_start()[0] == "/opt/cortex/venv/bin/cortex"
    assert unit.exec_start()[-2:] == ["--config", "/etc/cortex/cortex.toml"]
    assert unit.value("User") == unit.value("Group") == "cortex"
    assert unit.value("Restart") == "on-failure"
    assert unit.value("KillSignal") == "SIGTERM"
    assert unit.value("StandardOutput") == unit.value("StandardError") == "journal"
    assert unit.value("ProtectSystem") == "strict"
    assert set(" ".join(unit.values("ReadWritePaths")).split()) == STATE_FOLDERS
    for setting in ("NoNewPrivileges", "PrivateTmp", "ProtectHome", "RestrictSUIDSGID"):
        assert unit.value(setting) == "yes", setting
    assert unit.value("CapabilityBoundingSet") is None  # set empty: no capability at all
    assert "CapabilityBoundingSet" in {key for _, key, _ in unit.entries}
    assert unit.value("WantedBy", "Install") == "multi-user.target"


def test_the_gateway_and_the_node_say_when_they_are_ready():
    for service in ("cortex-gateway.service", "cortex-node@.service"):
        unit = load(UNITS_DIR / service)
        assert (unit.value("Type"), unit.value("NotifyAccess")) == ("notify", "main")
    assert load(UNITS_DIR / "cortex-batch.service").value("Type") == "exec"


def test_the_node_instance_picks_its_name_and_its_settings_file():
    unit = load(UNITS_DIR / "cortex-node@.service", "gpu0")
    env = unit.environment(
        read_file=lambda path: {"/etc/cortex/node-gpu0.env": "CORTEX_DEVICE=cuda:0\n"}[path]
    )
    assert env["CORTEX_NODE_NAME"].endswith("-gpu0")
    assert env["CORTEX_DEVICE"] == "cuda:0"
    assert unit.value("KillMode") == "mixed"  # SIGTERM to the agent, which stops its ranks itself


def test_the_folders_the_config_writes_are_the_ones_the_units_may_write():
    text = (PACKAGING / "cortex.toml").read_text()
    written = re.findall(
        r'^(?:models_dir|hf_cache|convert_cache|compile_cache) = "([^"]+)"', text, re.M
    )
    assert len(written) == 4
    for folder in written:
        assert any(folder.startswith(state + "/") for state in STATE_FOLDERS), folder


def test_the_redis_drop_in_adds_cortex_settings_after_redis_own():
    unit = load(REDIS_DROP_IN)
    assert unit.values("ExecStart")[0].split()[:2] == [
        "/usr/bin/redis-server",
        "/etc/redis/redis.conf",
    ]
    assert unit.exec_start()[-2:] == ["--include", "/etc/cortex/redis.conf"]
    assert len(unit.values("ExecStart")) == 1  # `ExecStart=` first: it replaces the distribution's


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not on PATH")
def test_redis_takes_the_settings_file(tmp_path):
    """packaging/redis.conf, included as the drop-in includes it, is what Redis runs with."""
    port = free_port()
    (tmp_path / "redis.conf").write_text("appendonly no\n")  # a distribution's, read first
    server = Service(
        "redis-server",
        [
            shutil.which("redis-server"),
            str(tmp_path / "redis.conf"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(tmp_path),
            "--include",
            str(PACKAGING / "redis.conf"),
        ],
        tmp_path / "redis.log",
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        server.wait_ready(lambda: redis_answers(url))
        client = redis.Redis.from_url(url, decode_responses=True)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        limits = client.config_get("client-output-buffer-limit")["client-output-buffer-limit"]
        assert "pubsub 268435456 67108864 60" in limits
        client.close()
    finally:
        server.stop()
