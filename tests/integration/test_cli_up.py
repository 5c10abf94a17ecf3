"""`cortex up` with a real redis-server and stand-ins for the gateway and the node agent:
a child that dies stops the rest, a signal stops everything, nothing is left running."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from gateway.cli import main, run_file
from shared.processes import free_port, redis_answers, redis_server_argv, start
from tests.conftest import wait_until

real_python = sys.executable

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


def up_args(redis_port: int, redis_dir: Path, *more: str):
    return main.build_parser().parse_args(
        [
            "up",
            "--port",
            str(free_port()),
            "--redis-port",
            str(redis_port),
            "--stop-timeout-s",
            "3",
            "--redis-dir",
            str(redis_dir),
            *more,
        ]
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

    code = main.cmd_up(up_args(redis_port, fake_python / "redis"))

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
        code = main.cmd_up(up_args(redis_port, fake_python / "redis"))
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
        code = main.cmd_up(up_args(busy.getsockname()[1], fake_python / "redis"))
    assert code == 2
    assert "CORTEX_UP_REDIS_PORT" in capsys.readouterr().out


def run_up_while(args, action) -> tuple[int, object]:
    """`cortex up` in the foreground while another thread runs `action(redis client)` once its Redis
    answers, then sends SIGTERM; returns the exit code and what `action` returned."""
    client = redis.Redis(port=args.redis_port, socket_connect_timeout=0.5)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    result = []

    def act() -> None:
        try:
            wait_until(
                lambda: run_file.read() is not None, 30, "cortex up"
            )  # written once every part started
            result.append(action(client))
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=act)
    thread.start()
    try:
        code = main.cmd_up(args)
    finally:
        thread.join()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return code, result[0] if result else None


def test_what_redis_holds_survives_a_restart_of_the_stack(fake_python, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_DIES", "")
    data = fake_python / "data"
    code, _ = run_up_while(
        up_args(free_port(), data), lambda client: client.set("cortex:apikeys", "kept")
    )
    assert code == 0
    assert "append-only file fsynced every second + snapshots in" in capsys.readouterr().out
    assert (data / "appendonlydir").is_dir() and (data / "dump.rdb").is_file()

    code, kept = run_up_while(
        up_args(free_port(), data), lambda client: client.get("cortex:apikeys")
    )
    assert (code, kept) == (0, b"kept")


def test_a_killed_redis_is_started_again_with_its_data(fake_python, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_DIES", "")
    args = up_args(free_port(), fake_python / "data")

    def kill_redis(client):
        client.set("cortex:file:f1", "content")
        pid = client.info("server")["process_id"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if client.info("server")["process_id"] != pid:
                    return client.get("cortex:file:f1")
            except redis.RedisError:
                pass
            time.sleep(0.1)

    code, kept = run_up_while(args, kill_redis)
    assert (code, kept) == (0, b"content")
    out = capsys.readouterr().out
    assert "redis-server exited with code -9" in out and "redis-server is back on" in out


def test_one_data_directory_serves_one_stack(fake_python, monkeypatch):
    monkeypatch.setenv("FAKE_DIES", "")
    data = fake_python / "data"
    second = [
        real_python,
        "-m",
        "gateway.cli",
        "up",
        "--port",
        str(free_port()),
        "--redis-port",
        str(free_port()),
        "--redis-dir",
        str(data),
    ]
    code, refused = run_up_while(
        up_args(free_port(), data),
        lambda client: subprocess.run(second, capture_output=True, text=True, timeout=60),
    )
    assert code == 0 and refused.returncode == 2
    assert f"{data} is in use by `cortex up` pid {os.getpid()}" in refused.stdout


def test_a_snapshot_without_an_append_only_file_is_loaded_then_made_durable(
    fake_python, monkeypatch, tmp_path
):
    monkeypatch.setenv("FAKE_DIES", "")
    data = tmp_path / "data"
    data.mkdir()
    port = free_port()
    server = start(
        "redis-server", redis_server_argv(port, workdir=data)
    )  # persistence off: no append-only file
    client = redis.Redis(port=port)
    wait_until(lambda: redis_answers(f"redis://127.0.0.1:{port}/0"), 10, "redis-server")
    client.set("k", "v")
    client.save()
    server.stop()
    assert (data / "dump.rdb").is_file() and not (data / "appendonlydir").exists()

    code, found = run_up_while(
        up_args(free_port(), data), lambda client: (client.get("k"), client.info("persistence"))
    )
    assert code == 0 and found[0] == b"v" and found[1]["aof_enabled"] == 1
    assert (data / "appendonlydir").is_dir()


def test_persistence_off_keeps_nothing(fake_python, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_DIES", "")
    args = up_args(free_port(), tmp_path / "data", "--redis-persistence", "off")
    code, config = run_up_while(
        args, lambda client: (client.config_get("appendonly"), client.config_get("save"))
    )
    assert code == 0 and config == ({"appendonly": "no"}, {"save": ""})
    assert not (tmp_path / "data").exists()


def test_backup_then_the_documented_restore(fake_python, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FAKE_DIES", "")
    saved = tmp_path / "backups" / "cortex.rdb"

    def write_then_back_up(client):
        client.hset("cortex:apikeys", "hash", "alice")
        return main.cmd_backup(main.build_parser().parse_args(["backup", str(saved)]))

    code, backed_up = run_up_while(up_args(free_port(), tmp_path / "data"), write_then_back_up)
    assert (code, backed_up) == (0, 0) and saved.stat().st_size > 0
    assert f"wrote {saved}" in capsys.readouterr().out

    restored = (
        tmp_path / "restored"
    )  # as docs/operations.md says: the file as dump.rdb, no appendonlydir
    restored.mkdir()
    shutil.copyfile(saved, restored / "dump.rdb")
    code, found = run_up_while(
        up_args(free_port(), restored), lambda client: client.hget("cortex:apikeys", "hash")
    )
    assert (code, found) == (0, b"alice")
    code, found = run_up_while(
        up_args(free_port(), restored), lambda client: client.hget("cortex:apikeys", "hash")
    )
    assert (code, found) == (0, b"alice")  # and from its append-only file from then on
