"""The one process supervisor (`cortex up`, the benchmark and the test fixtures use it)."""

import signal
import sys
import time
from pathlib import Path

from shared import processes


def test_supervisor_stops_in_reverse_order_and_kills_stragglers(tmp_path: Path):
    stubborn = tmp_path / "stubborn-ready"
    ignore_term = (
        "import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(stubborn)!r}).touch(); time.sleep(60)"
    )
    sup = processes.Supervisor(stop_timeout_s=0.5)
    first = sup.start("first", [sys.executable, "-c", ignore_term])
    second = sup.start("second", ["sleep", "60"])
    deadline = time.monotonic() + 10
    while not stubborn.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sup.first_dead() is None
    stopped = []

    sup.stop_all(log=stopped.append)

    assert stopped[0].startswith("stopping second") and stopped[1].startswith("stopping first")
    assert second.proc.returncode == -signal.SIGTERM
    assert first.proc.returncode == -signal.SIGKILL


def test_supervisor_notices_a_dead_child():
    sup = processes.Supervisor(stop_timeout_s=1)
    sup.start("alive", ["sleep", "60"])
    dead = sup.start("dies", [sys.executable, "-c", "raise SystemExit(3)"])
    dead.proc.wait()
    try:
        assert sup.first_dead() is dead
    finally:
        sup.stop_all(log=lambda _: None)
    assert all(c.proc.returncode is not None for c in sup.children)
