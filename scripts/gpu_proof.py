"""The GPU proof: on a GPU host, one command runs the GPU test tier and the GPU benchmarks and writes
one markdown table and the logs under a folder (scripts/gpu-proof is the entry point; it installs
the offline bundle's wheels first where the host lacks them).

Stages, one after another, each a child process with its own time limit (SIGTERM at the limit, so
a benchmark still prints and saves what it measured; SIGKILL 20 s later):
  imports    every package the stages import, and CUDA; a missing one stops the proof at once
  tests      the GPU tier (tests/gpu): greedy equality under CUDA graphs, paged KV + prefix hits
             and preemption under graphs, captured = uncaptured, compiled steps, TP where 2 GPUs
  streams    scripts/bench_run.py --device cuda on a Qwen3-0.6B-shaped random model at N = 1, 8,
             64, 128: HF generate, the engine in-process against its capture ceiling, the gateway
             (the served path) and transformers serve beside it
  multiturn  agents resending growing conversations through the gateway: prefix hits on paged KV
             under CUDA graphs, TTFT of first and later turns
  speculation  the edit workload in the in-process engine, n-gram speculation off and on at N = 1,
             4, 16: on random weights what verifying drafts costs a step, not their acceptance
  quant      a Qwen3-8B-shaped random model in the in-process engine as bfloat16, int4 and fp8
             weights at N = 1 and 64: tok/s, the weights' bytes and CUDA's peak memory (int8 left
             out: ATen's int8 kernel on CUDA is 6-56x slower than bfloat16, docs/benchmarks.md)

Files under OUT (few: hosts return at most eight): gpu-proof.md (the table), streams.json,
multiturn.json, speculation.json, quant.json, and logs.tar.gz (the environment, each stage's log, and the
gateway's, node's and redis' logs of every benchmark stack).

--dry-run runs the same stages on CPU with tiny shapes (the suite runs it): the GPU tier then
skips, saying so, and the benchmarks run a tiny random model for a few tokens."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPORTS = [
    "torch",
    "transformers",
    "safetensors",
    "tokenizers",
    "jinja2",
    "msgpack",
    "httpx",
    "rich",
    "redis",
    "fastapi",
    "uvicorn",
    "pydantic",
    "pydantic_settings",
    "arq",
    "gguf",
    "llguidance",
    "openai",
    "anthropic",
    "prometheus_client",
    "pytest",
    "pytest_asyncio",
    "fakeredis",
    "gateway.http.server",
    "node_agent.engine.engine",
    "node_agent.serving.agent",
]


@dataclass
class Stage:
    name: str
    argv: list[str]
    limit_s: float
    log: str
    result: str = "not run"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def stages(args, tokenizer: list[str]) -> list[Stage]:
    py = sys.executable
    bench = [py, str(ROOT / "scripts" / "bench_run.py"), "--keep-logs", "--retries", "0"]
    tests = [
        py,
        "-m",
        "pytest",
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        "--junitxml",
        str(args.work / "tests.xml"),
        "tests/gpu",
    ]
    if args.dry_run:
        streams = [
            *bench,
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--concurrency",
            "1,2",
            "--max-tokens",
            "8",
            "--json",
            str(args.out / "streams.json"),
        ]
        multiturn = [
            *bench,
            "--workload",
            "multiturn",
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--agents",
            "2",
            "--turns",
            "2",
            "--system-tokens",
            "64",
            "--user-tokens",
            "16",
            "--answer-tokens",
            "4",
            "--skip-vllm",
            "--skip-serve",
            "--json",
            str(args.out / "multiturn.json"),
        ]
        speculation = [
            *bench,
            "--workload",
            "edit",
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--concurrency",
            "1,2",
            "--max-tokens",
            "8",
            "--file-tokens",
            "64",
            "--skip-gateway",
            "--skip-vllm",
            "--json",
            str(args.out / "speculation.json"),
        ]
        quant = [
            *bench,
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--concurrency",
            "1,2",
            "--max-tokens",
            "8",
            "--quant",
            "none,int4,int8",
            "--skip-hf",
            "--skip-gateway",
            "--skip-serve",
            "--skip-vllm",
            "--json",
            str(args.out / "quant.json"),
        ]
        limits = (120, 240, 180, 180, 180)
    else:
        streams = [
            *bench,
            "--device",
            "cuda",
            "--shape",
            args.shape,
            *tokenizer,
            "--concurrency",
            "1,8,64,128",
            "--json",
            str(args.out / "streams.json"),
        ]
        multiturn = [
            *bench,
            "--workload",
            "multiturn",
            "--device",
            "cuda",
            "--shape",
            args.shape,
            *tokenizer,
            "--agents",
            "16",
            "--turns",
            "4",
            "--system-tokens",
            "2000",
            "--skip-serve",
            # the default 2 GB cache holds ~18,700 tokens of this shape: 16 agents' ~2,600 need ~4.6 GB
            "--kv-cache-mb",
            "8192",
            "--json",
            str(args.out / "multiturn.json"),
        ]
        # a random model's drafts say nothing of acceptance: this measures what verifying them costs a step,
        # in the engine alone
        speculation = [
            *bench,
            "--workload",
            "edit",
            "--device",
            "cuda",
            "--shape",
            args.shape,
            *tokenizer,
            "--concurrency",
            "1,4,16",
            "--max-tokens",
            "128",
            "--skip-gateway",
            "--json",
            str(args.out / "speculation.json"),
        ]
        # 16 GB of random bf16 weights built and saved once (~1 min), then loaded as each quant
        quant = [
            *bench,
            "--device",
            "cuda",
            "--shape",
            "qwen3-8b",
            *tokenizer,
            "--concurrency",
            "1,64",
            "--max-tokens",
            "64",
            "--quant",
            "none,int4,fp8",
            "--skip-hf",
            "--skip-gateway",
            "--skip-serve",
            "--skip-ceiling",
            "--json",
            str(args.out / "quant.json"),
        ]
        limits = (150, 240, 100, 120, 380)
    return [
        Stage("tests", tests, limits[0], "tests.log"),
        Stage("streams", streams, limits[1], "streams.log"),
        Stage("multiturn", multiturn, limits[2], "multiturn.log"),
        Stage("speculation", speculation, limits[3], "speculation.log"),
        Stage("quant", quant, limits[4], "quant.log"),
    ]


def run_stage(stage: Stage, logs: Path, env: dict) -> None:
    t0 = time.monotonic()
    with open(logs / stage.log, "w") as log:
        log.write(f"$ {' '.join(stage.argv)}\n")
        log.flush()
        proc = subprocess.Popen(
            stage.argv,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=stage.limit_s)
            stage.result = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(
                proc.pid, signal.SIGTERM
            )  # the bench tears its stack down and saves the partial report
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            stage.result = f"stopped at its {stage.limit_s:.0f} s limit"
    stage.seconds = time.monotonic() - t0
    print(f"[gpu-proof] {stage.name}: {stage.result} ({stage.seconds:.0f} s)", flush=True)


def check_imports(args, env: dict) -> str | None:
    """None when every import works (and CUDA is there, unless a dry run); else what is missing."""
    code = (
        "import importlib, sys\nmissing = []\n"
        f"for name in {IMPORTS!r}:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception as e:\n        missing.append(f'{name}: {type(e).__name__}: {e}')\n"
        "import torch\n"
        f"if not {args.dry_run!r} and not torch.cuda.is_available():\n    missing.append('torch: no CUDA device')\n"
        "print('\\n'.join(missing))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    missing = (
        done.stdout.strip() or (done.stderr.strip().splitlines() or ["the import check failed"])[-1]
    )
    if done.returncode == 0 and not done.stdout.strip():
        missing = None
    if shutil.which("redis-server", path=env["PATH"]) is None:
        missing = "\n".join(filter(None, [missing, "redis-server: not on PATH"]))
    return missing


def environment(env: dict) -> str:
    code = (
        "import torch, transformers, platform\n"
        "print('python', platform.python_version(), '| torch', torch.__version__, '| CUDA', torch.version.cuda,"
        " '| transformers', transformers.__version__)\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    print(f'{torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    lines = [done.stdout.strip() or done.stderr.strip()[-500:]]
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
        )
        lines.append("nvidia-smi: " + (smi.stdout.strip() or smi.stderr.strip()))
    lines.append(f"host: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}")
    lines.append(f"commit: {git_commit()}")
    return "\n".join(lines)


def git_commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


# ---- the report ------------------------------------------------------------------------------


def fmt(value, digits: int = 1) -> str:
    return "—" if value is None or value != value else f"{value:,.{digits}f}"


def tests_section(xml_path: Path) -> list[str]:
    if not xml_path.exists():
        return ["No test report (see tests.log in logs.tar.gz)."]
    root = ET.parse(xml_path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed, skipped = [], set()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failed.append(
                f"- `{name}`: {(bad.get('message') or '').splitlines()[0][:300] if bad.get('message') else ''}"
            )
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            skipped.add((case.find("skipped").get("message") or "").splitlines()[0][:200])
        else:
            counts["passed"] += 1
    lines = [f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped."]
    lines += failed
    lines += [f"- skipped: {why}" for why in sorted(skipped)]
    return lines


def streams_section(
    path: Path, what: str = "greedy, EOS ignored.", memory: bool = False
) -> list[str]:
    """A streams run's table and its ratios; `memory`: with what each row's weights, KV cache and
    peak held (a --quant run)."""
    if not path.exists():
        return [f"No results (see {path.stem}.log in logs.tar.gz)."]
    doc = json.loads(path.read_text())
    meta = doc["meta"]
    held = ["weights MiB", "KV cache MiB", "peak MiB"] if memory else []
    lines = [
        f"{meta.get('model')} {meta.get('dtype')} on {meta.get('device')}, {meta.get('max_tokens')} tokens a "
        f"stream, {what}",
        "",
        "| "
        + " | ".join(
            [
                "N",
                "system",
                "TTFT p50 ms",
                "aggregate tok/s",
                "per-stream tok/s",
                "ms/step",
                *held,
                "errors",
            ]
        )
        + " |",
        "|--:|---|" + "--:|" * (5 + len(held)),
    ]
    for r in sorted(doc["results"], key=lambda r: (r["concurrency"], r["system"])):
        m = r.get("memory") or {}
        held_cells = (
            [
                fmt(m.get("weight_mb"), 0),
                fmt(m.get("kv_cache_mb"), 0),
                fmt(m.get("cuda_peak_mb", m.get("peak_rss_mb")), 0),
            ]
            if memory
            else []
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    str(r["concurrency"]),
                    r["system"],
                    fmt(r["ttft_p50_ms"], 0),
                    fmt(r["aggregate_tok_s"]),
                    fmt(r["per_stream_tok_s"]),
                    fmt(r["step_ms"], 2),
                    *held_cells,
                    str(r["errors"] or ""),
                ]
            )
            + " |"
        )
    if doc.get("ratios"):
        lines += ["", "| ratio (same run) | N | value |", "|---|--:|--:|"]
        lines += [
            f"| {r['name']} | {r['concurrency']} | {fmt(r['value'], 2)} |" for r in doc["ratios"]
        ]
    lines += [
        f"- {system}: {why}"
        for system, why in {**doc.get("failures", {}), **doc.get("skipped", {})}.items()
    ]
    return lines


def multiturn_section(path: Path) -> list[str]:
    if not path.exists():
        return ["No results (see multiturn.log in logs.tar.gz)."]
    doc = json.loads(path.read_text())
    meta = doc["meta"]
    lines = [
        f"{meta.get('model')} {meta.get('dtype')} on {meta.get('device')}.",
        "",
        "| system | first-turn TTFT p50 ms | later-turn TTFT p50 ms | later / first | cached % (later) | wall s | errors |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in doc["results"]:
        lines.append(
            f"| {r['system']} | {fmt(r['first_ttft_p50_ms'], 0)} | {fmt(r['later_ttft_p50_ms'], 0)} | "
            f"{fmt(r['later_over_first'], 3)} | {fmt(r['later_cached_pct'], 0)} | {fmt(r['wall_s'])} | "
            f"{r['errors'] or ''} |"
        )
    lines += [
        f"- {system}: {why}"
        for system, why in {**doc.get("failures", {}), **doc.get("skipped", {})}.items()
    ]
    return lines


def speculation_section(path: Path) -> list[str]:
    if not path.exists():
        return ["No results (see speculation.log in logs.tar.gz)."]
    doc = json.loads(path.read_text())
    rows = doc["results"]
    keys = [
        k
        for k in (
            "system",
            "speculation",
            "concurrency",
            "aggregate_tok_s",
            "per_stream_tok_s",
            "step_ms",
            "draft_tokens",
            "acceptance",
        )
        if rows and k in rows[0]
    ]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                fmt(r[k], 2) if isinstance(r[k], float) or r[k] is None else str(r[k]) for k in keys
            )
            + " |"
        )
    lines += [
        "",
        "| aggregate tok/s against speculation off (same run) | N | value |",
        "|---|--:|--:|",
    ]
    lines += [
        f"| {r['system']}, {r['speculation']} | {r['concurrency']} | {fmt(r['vs_off'], 2)} |"
        for r in doc.get("ratios", [])
    ]
    return lines


def report(args, env_text: str, done: list[Stage], missing: str | None) -> str:
    title = "GPU proof (dry run on CPU)" if args.dry_run else "GPU proof"
    lines = [f"# {title}, {time.strftime('%Y-%m-%d %H:%M %Z')}", "", "```", env_text, "```", ""]
    if missing:
        lines += ["**Stopped before the first stage: imports missing**", "", "```", missing, "```"]
        return "\n".join(lines) + "\n"
    lines += ["| stage | result | seconds |", "|---|---|--:|"]
    lines += [f"| {s.name} | {s.result} | {s.seconds:.0f} |" for s in done]
    lines += [
        "",
        "## GPU test tier",
        "",
        *tests_section(args.work / "tests.xml"),
        "",
        "## Streams",
        "",
        *streams_section(args.out / "streams.json"),
        "",
        "## Multiturn (prefix hits on paged KV)",
        "",
        *multiturn_section(args.out / "multiturn.json"),
        "",
        "## Speculation: what verifying drafts costs a step",
        "",
        *speculation_section(args.out / "speculation.json"),
        "",
        "## Quantized weights: an 8B shape, each quant against bfloat16",
        "",
        *streams_section(args.out / "quant.json", "greedy; the engine in-process.", memory=True),
    ]
    return "\n".join(lines) + "\n"


def pack_logs(work: Path, out: Path) -> None:
    """Every stage's log and every benchmark stack's (gateway, node, redis), in one file."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for f in sorted(work.glob("*.log")):
            tar.add(f, arcname=f.name)
        for folder in sorted(work.glob("tmp/cortex-bench-*")):
            for f in folder.rglob("*.log"):
                tar.add(f, arcname=f"stacks/{folder.name}/{f.relative_to(folder)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/gpu-proof",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", type=Path, default=Path("gpu-proof-out"), help="where the table and logs go"
    )
    p.add_argument("--dry-run", action="store_true", help="the same stages on CPU with tiny shapes")
    p.add_argument(
        "--shape",
        default="qwen3-0.6b",
        help="the benchmarks' random model shape (scripts/bench_models.py)",
    )
    p.add_argument(
        "--tokenizer",
        default=".offline/smollm2-tokenizer",
        help="the default model's tokenizer as a folder (scripts/bench_run.py --export-tokenizer)",
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated stages to run (tests, streams, multiturn, speculation, quant)",
    )
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(
        os.environ.get("CORTEX_GPU_PROOF_WORK") or (args.out.parent / f".{args.out.name}-work")
    ).resolve()
    shutil.rmtree(args.work, ignore_errors=True)
    (args.work / "tmp").mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(args.work / "tmp"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env_text = environment(env)
    (args.work / "environment.log").write_text(env_text + "\n")
    print(env_text, flush=True)
    missing = check_imports(args, env)
    tokenizer = []
    if not args.dry_run:
        if Path(ROOT / args.tokenizer).is_dir():
            tokenizer = ["--tokenizer", str(ROOT / args.tokenizer)]
        else:
            missing = "\n".join(
                filter(
                    None,
                    [
                        missing,
                        f"tokenizer folder {args.tokenizer} is missing "
                        "(scripts/gpu-proof --prepare makes it)",
                    ],
                )
            )
    done: list[Stage] = []
    if missing:
        print(f"[gpu-proof] stopping: missing\n{missing}", file=sys.stderr)
    else:
        chosen = set(args.only.split(",")) if args.only else None
        for stage in stages(args, tokenizer):
            if chosen is None or stage.name in chosen:
                run_stage(stage, args.work, env)
                done.append(stage)
    pack_logs(args.work, args.out)
    text = report(args, env_text, done, missing)
    (args.out / "gpu-proof.md").write_text(text)
    print(text)
    if missing:
        return 2
    return 0 if all(s.result == "ok" for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
