"""What every workload of `scripts/bench` shares: the log line, one stream's measurements and their
percentiles, the CPU meter that flags noisy waves, the child processes, and the streaming HTTP client
(one OpenAI-style chat completion over SSE), used for Cortex's gateway and for every peer alike."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared import processes

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- measurements --------------------------------------------------------------------------


@dataclass
class Stream:
    ttft_s: float = math.nan  # request sent -> first token
    total_s: float = math.nan  # request sent -> last token / end of stream
    tokens: int = 0  # completion tokens (the final chunk's usage, else the content chunks counted)
    error: str | None = None
    prompt_tokens: int | None = None  # from usage, when the server sends it
    cached_tokens: int | None = (
        None  # usage.prompt_tokens_details.cached_tokens, when the server sends it
    )
    text: str = (
        ""  # the content streamed (a multi-turn conversation sends it back as the assistant's turn)
    )

    @property
    def decode_tok_s(self) -> float:
        """This stream's rate after its first token (the client's view of decode speed)."""
        if self.tokens > 1 and self.total_s > self.ttft_s:
            return (self.tokens - 1) / (self.total_s - self.ttft_s)
        return self.tokens / self.total_s if self.total_s > 0 else math.nan


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    pos = (len(values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


NOISY_PCT = 5  # other processes' CPU share (of the whole machine) above which a wave is flagged
OWN_GROUPS: dict[
    int, str
] = {}  # process groups this run started (the stack, transformers serve) -> name
_SUBPROCESSES = {
    "node_agent.serving.output_process": "node output"
}  # a part's own children, named apart
_names: dict[int, str] = {}  # pid -> its name in the table


def _name(pid: int, group: int) -> str | None:
    if pid == os.getpid():
        return "bench"
    if (name := OWN_GROUPS.get(group)) is None:
        return None
    if pid not in _names:
        try:
            cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            cmdline = ""
        _names[pid] = next((n for module, n in _SUBPROCESSES.items() if module in cmdline), name)
    return _names[pid]


def _jiffies() -> tuple[int, int, dict[str, int]]:
    """(machine busy, machine total, ours by process name): CPU jiffies so far, all cores together.
    This process is "bench" (the client, or the in-process systems)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(fields)
    busy = total - fields[3] - fields[4]  # less idle and iowait
    ours: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if name := _name(int(entry.name), int(stat[2])):
            ours[name] = ours.get(name, 0) + int(stat[11]) + int(stat[12])
    return busy, total, ours


class CpuMeter:
    """CPU use during a wave: how much of the machine other processes took (the noise
    indicator), and how many cores each of ours kept busy."""

    def __enter__(self):
        try:
            self.start, self.t0 = _jiffies(), time.monotonic()
        except OSError:  # no /proc: not Linux
            self.start = None
        self.other_pct = math.nan
        self.cores: dict[str, float] = {}
        return self

    def __exit__(self, *exc):
        if self.start is None:
            return
        busy, total, ours = _jiffies()
        busy, total = busy - self.start[0], total - self.start[1]
        own = {k: v - self.start[2].get(k, 0) for k, v in ours.items()}
        if total > 0:
            self.other_pct = max(busy - sum(own.values()), 0) / total * 100
        hz, wall = os.sysconf("SC_CLK_TCK"), time.monotonic() - self.t0
        if wall > 0:
            self.cores = {k: round(v / hz / wall, 2) for k, v in sorted(own.items())}


@dataclass
class Wave:
    system: str
    concurrency: int
    wall_s: float
    streams: list[Stream]
    other_cpu_pct: float = math.nan
    cores: dict[str, float] = field(default_factory=dict)  # cores each of our processes kept busy
    step_ms: float = (
        math.nan
    )  # engine: median wall of its steps while every row decodes; ceiling: one replay
    memory: dict = field(
        default_factory=dict
    )  # Cortex rows: weight_mb, and the node's rss_mb / peak_rss_mb or CUDA's

    def summary(self) -> dict:
        ok = [s for s in self.streams if s.error is None]
        tokens = sum(s.tokens for s in ok)
        return {
            "system": self.system,
            "concurrency": self.concurrency,
            "ttft_p50_ms": percentile([s.ttft_s * 1000 for s in ok], 50),
            "ttft_p95_ms": percentile([s.ttft_s * 1000 for s in ok], 95),
            "per_stream_tok_s": percentile([s.decode_tok_s for s in ok], 50),
            "aggregate_tok_s": tokens / self.wall_s if self.wall_s > 0 else math.nan,
            "tokens": tokens,
            "wall_s": self.wall_s,
            "errors": len(self.streams) - len(ok),
            "step_ms": self.step_ms,
            "other_cpu_pct": self.other_cpu_pct,
            "cores_busy": self.cores,
            "first_error": next((s.error for s in self.streams if s.error), None),
            "memory": self.memory,
        }


def rss_mb(pid: int | str = "self") -> dict:
    """A process's resident memory now and at its peak, in MiB (Linux /proc; empty elsewhere)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    kib = lambda name: int(fields[name].split()[0]) if name in fields else 0  # noqa: E731
    return {"rss_mb": kib("VmRSS") // 1024, "peak_rss_mb": kib("VmHWM") // 1024}


# ---- processes -----------------------------------------------------------------------------


class Procs:
    """The run's child processes under the supervisor every part of Cortex is started by
    (shared/processes.py), each logging to `logdir/NAME.log`; `stop_all` ends them, last started first."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.supervisor = processes.Supervisor()

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        child = self.supervisor.start(
            name, argv, env, log_path=self.logdir / f"{name}.log", cwd=ROOT
        )
        OWN_GROUPS[child.proc.pid] = name
        return child.proc

    def check(self) -> None:
        if (dead := self.supervisor.first_dead()) is not None:
            raise RuntimeError(
                f"{dead.name} exited with {dead.proc.returncode}:\n{self.tail(dead.name)}"
            )

    def tail(self, name: str, lines: int = 25) -> str:
        try:
            return "\n".join(
                (self.logdir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:]
            )
        except OSError:
            return ""

    def stop_all(self) -> None:
        self.supervisor.stop_all()
        self.supervisor.children.clear()


def wait_until(what: str, probe, timeout_s: float, procs: Procs, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check()
        try:
            result = probe()
            if result:
                return result
        except Exception:
            pass
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not ready after {timeout_s:.0f} s")


# ---- the HTTP client -------------------------------------------------------------------------


async def concurrent_streams(
    requests: list[tuple[str, dict]], timeout_s: float
) -> tuple[float, list[Stream]]:
    """Every (URL, body) streamed at once; the wall time (to the last stream's end) and the streams."""
    import httpx

    limits = httpx.Limits(
        max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4
    )
    async with httpx.AsyncClient(
        limits=limits, timeout=httpx.Timeout(timeout_s, connect=30)
    ) as client:
        t0 = time.perf_counter()
        async with asyncio.timeout(timeout_s), asyncio.TaskGroup() as group:
            tasks = [group.create_task(one_http(client, url, body)) for url, body in requests]
        streams = [t.result() for t in tasks]
        ends = [s.total_s for s in streams if not math.isnan(s.total_s)]
        wall = max(ends) if ends else time.perf_counter() - t0
    return wall, streams


async def one_http(client, url: str, body: dict) -> Stream:
    """One streamed chat completion: its TTFT (to the first content delta), total time, tokens and text."""
    s = Stream()
    t0 = time.perf_counter()
    usage_tokens = None
    seen = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                s.error = (
                    f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                )
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    s.error = json.dumps(chunk["error"])[:300]
                    break
                if usage := chunk.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
                    s.prompt_tokens = usage.get("prompt_tokens")
                    s.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    )
                for choice in chunk.get("choices") or []:
                    if content := (choice.get("delta") or {}).get("content"):
                        s.text += content
                        seen += 1
                        now = time.perf_counter()
                        if math.isnan(s.ttft_s):
                            s.ttft_s = now - t0
                        s.total_s = now - t0
    except Exception as exc:  # a failed stream is reported, not raised
        s.error = f"{type(exc).__name__}: {exc}"
    s.total_s = time.perf_counter() - t0 if math.isnan(s.total_s) else max(s.total_s, 0.0)
    s.tokens = usage_tokens if usage_tokens is not None else seen
    return s


def finite(value):
    """NaN (a figure that could not be measured) becomes null, so the file is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def fmt(value: float, digits: int) -> str:
    return (
        "—"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:.{digits}f}"
    )


def verdict(ratio: dict) -> tuple[str, str]:
    """A ratio's target as printed (`≥ 0.95`) and whether the value meets it ('' without a target)."""
    if ratio.get("target") is None:
        return "", ""
    higher = ratio["better"] == "higher"
    met = ratio["value"] >= ratio["target"] if higher else ratio["value"] <= ratio["target"]
    return (
        "≥ " if higher else "≤ "
    ) + f"{ratio['target']:g}", "meets" if met else "below" if higher else "above"
