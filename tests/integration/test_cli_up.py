"""`cortex up` with a real redis-server and stand-ins for the gateway and the node agent:
a child that dies stops the rest, a signal stops everything, nothing is left running."""

import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from gateway.cli import main, run_file
from shared.processes import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not on PATH"),
]


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch) -> Path:
    """Stands in for `python -m gateway` / `python -m node_agent`: records its pid, then
    sleeps, or exits 3 when its module is named in $FAKE_DIES."""
    script = tmp_path / "python"
    script.write_text(
        "#!/bin/bash\n"
        f'echo "$$ $2" >> {tmp_path}/pids\n'
        '[ "$2" = "$FAKE_DIES" ] && { sleep 0.3; exit 3; }\n'
        "exec sleep 60\n"
    )
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))
    monkeypatch.delenv("CORTEX_REDIS_URL", raising=False)
    monkeypatch.delenv("CORTEX_CONFIG", raising=False)
    monkeypatch.setenv(run_file.RUN_FILE_ENV, str(tmp_path / "up.json"))
    return tmp_path


def up_args(redis_port: int):
    return main.build_parser().parse_args(
        ["up", "--port", str(free_port()), "--redis-port", str(redis_port), "--stop-timeout-s", "3"]
    )


def assert_nothing_left(tmp_path: Path, redis_port: int) -> None:
    for line in (tmp_path / "pids").read_text().split("\n"):
        if line:
            pid = int(line.split()[0])
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=redis_port, socket_connect_timeout=0.5).ping()


def test_a_dead_child_stops_the_rest_and_fails(fake_python, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_DIES", "node_agent")
    redis_port = free_port()

    code = main.cmd_up(up_args(redis_port))

    assert code == 1
    out = capsys.readouterr().out
    assert "node exited with code 3" in out and "all stopped" in out
    assert out.index("stopping gateway") < out.index("stopping redis")
    assert_nothing_left(fake_python, redis_port)


def test_sigterm_stops_everything_cleanly(fake_python, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_DIES", "")
    redis_port = free_port()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        started = time.monotonic()
        code = main.cmd_up(up_args(redis_port))
    finally:
        timer.cancel()
        for sig, handler in saved.items():
            signal.signal(sig, handler)

    assert code == 0
    assert time.monotonic() - started < 10
    out = capsys.readouterr().out
    assert f"find this stack through {fake_python / 'up.json'}" in out
    assert not (fake_python / "up.json").exists()  # removed on the way out
    assert out.index("stopping node") < out.index("stopping gateway") < out.index("stopping redis")
    assert_nothing_left(fake_python, redis_port)


def test_refuses_a_busy_redis_port(fake_python, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = main.cmd_up(up_args(busy.getsockname()[1]))
    assert code == 2
    assert "CORTEX_UP_REDIS_PORT" in capsys.readouterr().out
