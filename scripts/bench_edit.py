"""The edit workload of `scripts/bench` (issue 36): each request gives a source file of about
`--file-tokens` tokens and asks for it back with one small change, greedy, exactly `--max-tokens`
completion tokens (EOS ignored). The answer mostly repeats the prompt: what speculative decoding
from the prompt (`speculative = "ngram"`) is for.

It runs Cortex's engine in-process (no gateway, no Redis), once per speculation setting, at each
`--concurrency`: off; ngram as the catalogue runs it (off above `speculative_max_batch` decoding
sequences); ngram at every batch size (the backoff's reason). Per wave: aggregate and per-stream
tok/s, and the share of draft tokens accepted.
"""

from __future__ import annotations

import math
import random

import bench_text
from bench_core import CpuMeter, fmt, log

SETTINGS = {  # name -> the catalogue fields it sets
    "off": {"speculative": "off"},
    "ngram": {"speculative": "ngram"},
    "ngram, no backoff": {"speculative": "ngram", "speculative_max_batch": 1024},
}
VERBS = ["load", "parse", "merge", "check", "render", "count", "split", "flush", "score", "build"]
NOUNS = ["orders", "invoices", "routes", "records", "batches", "tickets", "reports", "shifts", "parcels", "rates"]


def _function(rng: random.Random) -> str:
    verb, noun, other = rng.choice(VERBS), rng.choice(NOUNS), rng.choice(NOUNS)
    limit, step = rng.randint(2, 90), rng.randint(1, 9)
    return (f"\n\ndef {verb}_{noun}(items, {other}=None):\n"
            f'    """{verb.capitalize()} the {noun} against the {other}, at most MAX_RETRIES times."""\n'
            f"    result = []\n"
            f"    for index, item in enumerate(items):\n"
            f"        if index > {limit} or item is None:\n"
            f"            continue\n"
            f"        value = item.get('{noun}', 0) * {step} + len({other} or [])\n"
            f"        result.append((index, value))\n"
            f"    return result\n")


def source_file(tokenizer, index: int, tokens: int) -> str:
    """A Python module of about `tokens` tokens, distinct per `index`."""
    rng = random.Random(index)
    head = f'"""Module {index}: helpers for the {rng.choice(NOUNS)} pipeline."""\n\nMAX_RETRIES = 3\n'
    return bench_text._grow(tokenizer, head, tokens, lambda: _function(rng))


def messages(tokenizer, index: int, tokens: int) -> list[dict]:
    """A request for file `index` back with one change (the phrasing SmolLM2-135M copies the file
    with; asked for "the whole file" after it, it writes a new one)."""
    source = source_file(tokenizer, index, tokens)
    return [{"role": "system", "content": "You are a code editor. You return the user's file with the requested change "
                                          "and nothing else."},
            {"role": "user", "content": f"```python\n{source}```\n\nSet MAX_RETRIES = 7."}]


def run(args, load_model, engine_wave) -> list[dict]:
    """Every setting at every concurrency, one engine per setting on one loaded model: the rows."""
    import torch

    from node_agent.engine.engine import Engine

    profile, loaded = load_model(args)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    asks = [messages(loaded.tokenizer, i, args.file_tokens) for i in range(max(args.concurrency))]
    rows = []
    for name, fields in SETTINGS.items():
        engine = Engine(loaded, profile.model_copy(update=fields), "bench")
        engine_wave(engine, loaded, profile, 1, 4, [messages(loaded.tokenizer, -1, args.file_tokens)])  # warm-up
        for n in args.concurrency:
            before = engine.spec_stats()
            with CpuMeter() as cpu:
                wave = engine_wave(engine, loaded, profile, n, args.max_tokens, asks[:n])
            after = engine.spec_stats()
            drafted, accepted = after.draft_tokens - before.draft_tokens, after.accepted_tokens - before.accepted_tokens
            row = wave.summary() | {"system": name, "other_cpu_pct": cpu.other_pct, "draft_tokens": drafted,
                                    "accepted_tokens": accepted,
                                    "acceptance": accepted / drafted if drafted else math.nan,
                                    "drafts": after.drafts - before.drafts}
            rows.append(row)
            log(f"{name} N={n}: {row['aggregate_tok_s']:.1f} tok/s, {row['per_stream_tok_s']:.1f} per stream, "
                f"acceptance {fmt(100 * row['acceptance'], 0)}% of {drafted} draft tokens")
        del engine
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Each speculating setting's aggregate tok/s over speculation off, per concurrency."""
    off = {r["concurrency"]: r for r in rows if r["system"] == "off"}
    return [{"system": r["system"], "concurrency": r["concurrency"],
             "vs_off": r["aggregate_tok_s"] / off[r["concurrency"]]["aggregate_tok_s"]}
            for r in rows if r["system"] != "off" and r["concurrency"] in off]


def print_report(args, rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"edit: ~{args.file_tokens}-token files, {args.max_tokens} tokens each, greedy; "
                        f"{meta['model']} {meta['dtype']}, {meta['cpu_count']} CPUs")
    for column in ("speculation", "N", "tok/s", "per stream tok/s", "TTFT p50 ms", "draft tokens", "accepted",
                   "× off", "other CPU %"):
        table.add_column(column, justify="left" if column == "speculation" else "right")
    vs_off = {(r["system"], r["concurrency"]): r["vs_off"] for r in ratios(rows)}
    for r in rows:
        table.add_row(r["system"], str(r["concurrency"]), fmt(r["aggregate_tok_s"], 1), fmt(r["per_stream_tok_s"], 1),
                      fmt(r["ttft_p50_ms"], 0), str(r["draft_tokens"]), fmt(100 * r["acceptance"], 0) + "%",
                      fmt(vs_off.get((r["system"], r["concurrency"]), math.nan), 2), fmt(r["other_cpu_pct"], 0))
    Console(width=140).print(table)
