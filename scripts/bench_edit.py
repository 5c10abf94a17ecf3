"""The edit workload of `scripts/bench` (issue 36): each request gives a source file of about
`--file-tokens` tokens and asks for it back with one small change, greedy, exactly `--max-tokens`
completion tokens (EOS ignored). The answer mostly repeats the prompt: what speculative decoding
from the prompt (`speculative = "ngram"`) is for.

Systems, one after another, each at every `--concurrency`:
  engine    Cortex's engine in-process (no gateway, no Redis), once per SETTINGS: off; ngram as the
            catalogue runs it (off above `speculative_max_batch` decoding sequences); suffix (ngram,
            and the model's recent outputs); ngram at every batch size (the backoff's reason)
  gateway   Cortex end to end, through HTTP: a stack of its own per `--speculative` setting
  vllm-cpu  vLLM's OpenAI server on CPU, through HTTP: without, then with its n-gram speculator
            (bench_servers.VLLM_NGRAM); a server that refuses to start is reported as skipped
Per wave: aggregate and per-stream tok/s, and the share of draft tokens accepted (the engine's
counters; a server's spec_decode counters on /metrics).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import bench_models
import bench_text
from bench_core import CpuMeter, fmt, log
from bench_servers import (
    NAMES,
    Served,
    each_served,
    http_servers,
    http_wave,
    peers_folder,
    spec_delta,
    warm_up,
)

SETTINGS = {  # name -> the catalogue fields it sets
    "off": {"speculative": "off"},
    "ngram": {"speculative": "ngram"},
    "suffix": {
        "speculative": "suffix"
    },  # the files differ: what it adds here is other answers' lines
    "ngram, no backoff": {"speculative": "ngram", "speculative_max_batch": 1024},
}
VERBS = ["load", "parse", "merge", "check", "render", "count", "split", "flush", "score", "build"]
NOUNS = [
    "orders",
    "invoices",
    "routes",
    "records",
    "batches",
    "tickets",
    "reports",
    "shifts",
    "parcels",
    "rates",
]


def _function(rng: random.Random) -> str:
    verb, noun, other = rng.choice(VERBS), rng.choice(NOUNS), rng.choice(NOUNS)
    limit, step = rng.randint(2, 90), rng.randint(1, 9)
    return (
        f"\n\ndef {verb}_{noun}(items, {other}=None):\n"
        f'    """{verb.capitalize()} the {noun} against the {other}, at most MAX_RETRIES times."""\n'
        f"    result = []\n"
        f"    for index, item in enumerate(items):\n"
        f"        if index > {limit} or item is None:\n"
        f"            continue\n"
        f"        value = item.get('{noun}', 0) * {step} + len({other} or [])\n"
        f"        result.append((index, value))\n"
        f"    return result\n"
    )


def source_file(tokenizer, index: int, tokens: int) -> str:
    """A Python module of about `tokens` tokens, distinct per `index`."""
    rng = random.Random(index)
    head = (
        f'"""Module {index}: helpers for the {rng.choice(NOUNS)} pipeline."""\n\nMAX_RETRIES = 3\n'
    )
    return bench_text._grow(tokenizer, head, tokens, lambda: _function(rng))


def messages(tokenizer, index: int, tokens: int) -> list[dict]:
    """A request for file `index` back with one change (the phrasing SmolLM2-135M copies the file
    with; asked for "the whole file" after it, it writes a new one)."""
    source = source_file(tokenizer, index, tokens)
    return [
        {
            "role": "system",
            "content": "You are a code editor. You return the user's file with the requested change "
            "and nothing else.",
        },
        {"role": "user", "content": f"```python\n{source}```\n\nSet MAX_RETRIES = 7."},
    ]


def run(
    args, workdir: Path, failures: dict[str, str], skipped: dict[str, str], load_model, engine_wave
) -> list[dict]:
    """Every chosen system at every concurrency: the rows. A system that fails goes into `failures`,
    a peer that could not be installed or started into `skipped`; the rest run."""
    tokenizer = bench_models.tokenizer_from(args.tokenizer)
    asks = [messages(tokenizer, i, args.file_tokens) for i in range(max(args.concurrency))]
    warm = messages(tokenizer, -1, args.file_tokens)  # a file no wave asks for
    rows: list[dict] = []
    if "engine" in args.systems:
        try:
            engine_rows(args, asks, warm, load_model, engine_wave, rows)
        except Exception as exc:
            failures["engine"] = f"{type(exc).__name__}: {exc}"
            log(f"engine failed: {failures['engine']}")
    servers = http_servers(args, workdir, peers_folder(args, failures))
    each_served(
        [s for s in args.systems if s in servers],
        servers,
        lambda served: http_rows(served, args, asks, warm, rows),
        failures,
        skipped,
    )
    return rows


def engine_rows(
    args, asks: list[list[dict]], warm: list[dict], load_model, engine_wave, rows: list[dict]
) -> None:
    """The engine in-process, one per setting on one loaded model (dropped at the end)."""
    from node_agent.engine.engine import Engine

    profile, loaded = load_model(args)
    for setting, fields in SETTINGS.items():
        engine = Engine(loaded, profile.model_copy(update=fields), "bench")
        engine_wave(engine, loaded, profile, 1, 4, [warm])
        for n in args.concurrency:
            before = engine.spec_stats().model_dump()
            with CpuMeter() as cpu:
                wave = engine_wave(engine, loaded, profile, n, args.max_tokens, asks[:n])
            wave.other_cpu_pct, wave.cores = cpu.other_pct, cpu.cores
            rows.append(
                _row(
                    "engine",
                    setting,
                    wave.summary(),
                    spec_delta(before, engine.spec_stats().model_dump()),
                )
            )
        del engine


def http_rows(
    served: Served, args, asks: list[list[dict]], warm: list[dict], rows: list[dict]
) -> None:
    """One server (`gateway`, `gateway ngram`, `vllm-cpu ngram` …) through HTTP, warmed up with one
    4-token request; the counters of a speculating one read before and after each wave."""
    system, _, setting = served.system.partition(" ")
    warm_up(served, args.timeout, warm)
    counters = served.spec() if served.spec else None
    for n in args.concurrency:
        wave = http_wave(served, asks[:n], args.max_tokens, args.timeout)
        before, counters = counters, served.spec() if served.spec else None
        rows.append(_row(system, setting or "off", wave.summary(), spec_delta(before, counters)))


def _row(system: str, setting: str, summary: dict, spec: dict) -> dict:
    row = summary | spec | {"system": system, "speculation": setting}
    log(
        f"{system} {setting} N={row['concurrency']}: {row['aggregate_tok_s']:.1f} tok/s, "
        f"{row['per_stream_tok_s']:.1f} per stream, acceptance {fmt(100 * row['acceptance'], 0)}% of "
        f"{fmt(row['draft_tokens'], 0)} draft tokens"
        + (f", {row['errors']} errors: {row['first_error']}" if row["errors"] else "")
    )
    return row


SYSTEMS = {"engine": "engine in-process", **NAMES}


def ratios(rows: list[dict]) -> list[dict]:
    """Each speculating row's aggregate tok/s over the same system's without speculation, same N."""
    off = {(r["system"], r["concurrency"]): r for r in rows if r["speculation"] == "off"}
    return [
        {
            "system": r["system"],
            "speculation": r["speculation"],
            "concurrency": r["concurrency"],
            "vs_off": r["aggregate_tok_s"] / base["aggregate_tok_s"]
            if base["aggregate_tok_s"]
            else math.nan,
        }
        for r in rows
        if r["speculation"] != "off" and (base := off.get((r["system"], r["concurrency"])))
    ]


def print_report(args, rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    table = Table(
        title=f"edit: ~{args.file_tokens}-token files, {args.max_tokens} tokens each, greedy; "
        f"{meta['model']} {meta['dtype']}, {meta['cpu_count']} CPUs; the engine in-process, "
        "the gateway and vLLM-CPU through HTTP (chat completions, SSE)"
    )
    for column in (
        "system",
        "speculation",
        "N",
        "tok/s",
        "per stream tok/s",
        "TTFT p50 ms",
        "draft tokens",
        "accepted %",
        "other CPU %",
        "errors",
    ):
        table.add_column(column, justify="left" if column in ("system", "speculation") else "right")
    for r in rows:
        table.add_row(
            SYSTEMS[r["system"]],
            r["speculation"],
            str(r["concurrency"]),
            fmt(r["aggregate_tok_s"], 1),
            fmt(r["per_stream_tok_s"], 1),
            fmt(r["ttft_p50_ms"], 0),
            fmt(r["draft_tokens"], 0),
            fmt(100 * r["acceptance"], 0),
            fmt(r["other_cpu_pct"], 0),
            str(r["errors"]) if r["errors"] else "",
        )
    console.print(table)
    rat = ratios(rows)
    if rat:
        pivot = Table(title="× off: tok/s over the same system's without speculation, same N")
        pivot.add_column("system, speculation")
        for n in args.concurrency:
            pivot.add_column(f"N={n}", justify="right")
        by = {(r["system"], r["speculation"], r["concurrency"]): r["vs_off"] for r in rat}
        for system, setting in dict.fromkeys((r["system"], r["speculation"]) for r in rat):
            pivot.add_row(
                f"{SYSTEMS[system]}, {setting}",
                *(fmt(by.get((system, setting, n), math.nan), 2) for n in args.concurrency),
            )
        console.print(pivot)
    for r in rows:
        if r["errors"]:
            console.print(
                f"[red]{SYSTEMS[r['system']]} {r['speculation']} N={r['concurrency']}: {r['errors']} failed "
                f"streams; first: {r['first_error']}[/red]"
            )
