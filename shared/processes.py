"""The one process supervisor: `cortex up`, the benchmark and the test fixtures start Redis, gateways,
batch workers and node agents through it. Each child runs in its own process group (a terminal's
Ctrl-C reaches only the supervisor; stopping a child takes whatever it started), gets SIGTERM if the
supervisor dies (Linux), and is stopped with SIGTERM, then SIGKILL after a grace period."""

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis

from shared.redis_conn import seed_urls


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the supervisor itself dies (Linux only)."""
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
    log_path: Path | None = None  # where its stdout and stderr go (None: the supervisor's own)
    env: dict[str, str] | None = None
    started: float = field(default_factory=time.monotonic)
    _log: IO[bytes] | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path else ""

    def stop(self, timeout_s: float = 10.0, log=lambda message: None, hurry=lambda: False) -> int:
        """SIGTERM, up to `timeout_s` (cut short when `hurry()`), then SIGKILL; then anything left
        in its process group goes too. Returns its exit code."""
        if self.alive():
            log(f"stopping {self.name} (pid {self.proc.pid})")
            _signal(self.proc, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.alive() and time.monotonic() < deadline and not hurry():
                time.sleep(0.05)
        if self.alive():
            log(f"{self.name} did not stop in {timeout_s:g}s; killing it")
            _signal(self.proc, signal.SIGKILL)
            self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._log is not None:
            self._log.close()
        return self.proc.returncode


def start(
    name: str,
    argv: list[str],
    env: dict[str, str] | None = None,
    *,
    log_path: Path | None = None,
    stop_timeout_s: float | None = None,
    cwd: Path | None = None,
    append: bool = False,
) -> Child:
    """Start one child in its own process group, its output to `log_path` when given (after what
    the file holds, with `append`)."""
    log = open(log_path, "ab" if append else "wb") if log_path is not None else None
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT if log else None,
        process_group=0,
        preexec_fn=_die_with_parent,
    )
    return Child(name, proc, stop_timeout_s, log_path, env, _log=log)


@dataclass
class Supervisor:
    """Children stopped in the reverse order of starting, each given `stop_timeout_s` (or its own)."""

    stop_timeout_s: float = 10.0
    children: list[Child] = field(default_factory=list)
    signals: int = 0  # how many stop signals arrived; a second one skips the grace period

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, **options
    ) -> Child:
        child = start(name, argv, env, **options)
        self.children.append(child)
        return child

    def restart(self, child: Child, argv: list[str] | None = None) -> Child:
        """Start a dead child again (with `argv`, or its own), in its place in the stopping order."""
        child.stop(0)
        again = start(
            child.name,
            argv or list(child.proc.args),
            child.env,
            log_path=child.log_path,
            stop_timeout_s=child.stop_timeout_s,
            append=True,
        )
        self.children[self.children.index(child)] = again
        return again

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)

    def stop_all(self, log=lambda message: None) -> None:
        for child in reversed(self.children):
            timeout_s = (
                self.stop_timeout_s if child.stop_timeout_s is None else child.stop_timeout_s
            )
            child.stop(timeout_s, log, hurry=lambda: self.signals >= 2)

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


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Redis's own default snapshot schedule (after 1 h and 1 change, 5 min and 100, 1 min and 10,000)
SNAPSHOTS = "3600 1 300 100 60 10000"
# What a pub/sub client (a gateway's event router) may leave unread before Redis cuts it: at once past
# 32 MB, or past 8 MB for 60 s (Redis's own defaults, set here knowingly). A cut drops every job's
# events on that gateway at once; nodes keep every event under `max_event_bytes` (64 KiB), so it takes
# hundreds of the largest unread to come near, and the gateway resumes its jobs from their event logs.
PUBSUB_BUFFER_LIMIT = "pubsub 32mb 8mb 60"


def redis_server_argv(
    port: int, *, workdir: Path | None = None, logfile: str | None = None, durable: bool = False
) -> list[str]:
    """A private redis-server on loopback; FileNotFoundError when none is installed. `durable`: an
    append-only file fsynced every second plus snapshots, both in `workdir` (what `cortex up` runs);
    otherwise nothing is kept across a restart (tests)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not on PATH")
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--client-output-buffer-limit", PUBSUB_BUFFER_LIMIT]
    if durable:
        if workdir is None:
            raise ValueError("a durable redis-server needs a workdir for its files")
        # a failed snapshot (a fork refused for memory) does not stop writes: the append-only file has them
        argv += [
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            SNAPSHOTS,
            "--stop-writes-on-bgsave-error",
            "no",
        ]
    else:
        argv += ["--save", "", "--appendonly", "no"]
    if workdir is not None:
        argv += ["--dir", str(workdir)]
    if logfile is not None:
        argv += ["--loglevel", "warning", "--logfile", logfile]
    return argv


def redis_answers(url: str) -> bool:
    """Redis at `url` answers PING (a cluster: one of the nodes its URL names)."""
    for one in seed_urls(url):
        client = redis.Redis.from_url(one, socket_connect_timeout=0.5, socket_timeout=1.0)
        try:
            if client.ping():
                return True
        except redis.RedisError:
            pass
        finally:
            client.close()
    return False


def wait_for_redis(url: str, child: Child | None, timeout_s: float = 15.0) -> bool:
    """Until Redis at `url` answers PING (False if `child` dies first or `timeout_s` passes)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            return False
        if redis_answers(url):
            return True
        time.sleep(0.05)
    return False
