"""The lora workload of `scripts/bench` (issue 51): what serving LoRA adapters costs the engine.
Cortex's engine in-process (no gateway, no Redis), on the run's model, its decode step built as a
node builds it (compiled on a CPU, node_agent/model/compiled_step.py), at every `--concurrency`
(default 32), greedy, `--max-tokens` each (EOS ignored), three waves, one after another, for
`--lora-rounds` rounds (default 3; a wave's figures are its median over the rounds):

  base        an engine without adapter slots (`max_loras = 0`): the model as it serves today
  base+lora   an engine with `--adapters` slots of rank `--lora-rank`, the adapters loaded, every
              request on the base: what the slots cost a base that uses none of them
  adapters    the same engine, the requests spread over the `--adapters` adapters in turn

The adapters are written here as PEFT writes them (`adapter_config.json`,
`adapter_model.safetensors`): random weights on every projection (q, k, v, o, gate, up, down) of
every layer, shaped by the model's config. The ratio reported is adapters / base (issue 51's
target: at least 0.8 at 32 streams on a CPU). Installing the slots wraps a loaded model's layers
in place, so the engine without slots runs on a copy of its own. Waves of one engine taken apart
(all of one, then all of the other) moved the base 7-20 % between runs of one commit; rounds of
all three, medians, compare them under the same conditions.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch
from bench_core import CpuMeter, fmt, log
from safetensors.torch import save_file

TARGETS = {  # projection -> (its input width, its output width), from the model's config
    "self_attn.q_proj": lambda c, hd: (c.hidden_size, c.num_attention_heads * hd),
    "self_attn.k_proj": lambda c, hd: (c.hidden_size, c.num_key_value_heads * hd),
    "self_attn.v_proj": lambda c, hd: (c.hidden_size, c.num_key_value_heads * hd),
    "self_attn.o_proj": lambda c, hd: (c.num_attention_heads * hd, c.hidden_size),
    "mlp.gate_proj": lambda c, hd: (c.hidden_size, c.intermediate_size),
    "mlp.up_proj": lambda c, hd: (c.hidden_size, c.intermediate_size),
    "mlp.down_proj": lambda c, hd: (c.intermediate_size, c.hidden_size),
}


def write_adapter(folder: Path, config, rank: int, seed: int) -> Path:
    """A random LoRA adapter of `rank` on every projection of a model with `config`, as PEFT saves
    one."""
    folder.mkdir(parents=True, exist_ok=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, shape in TARGETS.items():
            fan_in, fan_out = shape(config, head_dim)
            path = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{path}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.02
            tensors[f"{path}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=generator) * 0.02
            )
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": [name.split(".")[-1] for name in TARGETS],
                "bias": "none",
            }
        )
    )
    return folder


def run(args, workdir: Path, load_model, engine_wave) -> list[dict]:
    """The three waves at every concurrency, `--lora-rounds` times: the rows (medians)."""
    from node_agent.engine.engine import Engine
    from shared.settings import NodeSettings

    profile, plain_model = load_model(args)
    _, slotted_model = load_model(args)  # the slots wrap its layers in place
    names = [f"bench-lora-{i}" for i in range(args.adapters)]
    folders = [
        write_adapter(workdir / name, plain_model.model.config, args.lora_rank, seed)
        for seed, name in enumerate(names, start=1)
    ]
    compile_cache = NodeSettings().compile_cache  # each engine's decode step as a node builds it
    plain = Engine(plain_model, profile.model_copy(update={"max_loras": 0}), "bench", compile_cache)
    slots = {"max_loras": args.adapters, "max_lora_rank": args.lora_rank}
    slotted = Engine(slotted_model, profile.model_copy(update=slots), "bench", compile_cache)
    for name, folder in zip(names, folders):
        slotted.load_adapter(name, folder)
    waves = [
        ("base", plain, plain_model, [""]),
        ("base+lora", slotted, slotted_model, [""]),
        ("adapters", slotted, slotted_model, names),
    ]
    rows: list[dict] = []
    for n in args.concurrency:
        taken: dict[str, list[dict]] = {setting: [] for setting, *_ in waves}
        for _, engine, loaded, adapters in waves:  # warm-up: this concurrency's shapes
            engine_wave(engine, loaded, profile, n, 4, adapters=adapters)
        for round_ in range(args.lora_rounds):
            for setting, engine, loaded, adapters in waves:
                with CpuMeter() as cpu:
                    wave = engine_wave(
                        engine, loaded, profile, n, args.max_tokens, adapters=adapters
                    )
                wave.other_cpu_pct, wave.cores = cpu.other_pct, cpu.cores
                row = wave.summary() | {
                    "setting": setting,
                    "adapters": len([a for a in adapters if a]),
                }
                log(
                    f"round {round_ + 1}: engine {setting} N={n}: {row['aggregate_tok_s']:.1f} tok/s, "
                    f"step {fmt(row['step_ms'], 1)} ms, other CPU {fmt(row['other_cpu_pct'], 0)}%"
                    + (f", {row['errors']} errors: {row['first_error']}" if row["errors"] else "")
                )
                taken[setting].append(row)
        rows += [_median(setting, runs) for setting, runs in taken.items()]
    return rows


def _median(setting: str, runs: list[dict]) -> dict:
    """A wave's row over its rounds: each figure's median (errors summed)."""
    row = dict(runs[0])
    for key in ("aggregate_tok_s", "per_stream_tok_s", "step_ms", "ttft_p50_ms", "other_cpu_pct"):
        row[key] = statistics.median(r[key] for r in runs)
    row["errors"] = sum(r["errors"] for r in runs)
    row["rounds"] = len(runs)
    return row


def ratios(rows: list[dict]) -> list[dict]:
    """Each wave with slots over the plain base's aggregate tok/s, same N."""
    base = {r["concurrency"]: r for r in rows if r["setting"] == "base"}
    return [
        {
            "name": f"{r['setting']} / base",
            "concurrency": r["concurrency"],
            "value": r["aggregate_tok_s"] / b["aggregate_tok_s"]
            if b["aggregate_tok_s"]
            else math.nan,
        }
        for r in rows
        if r["setting"] != "base" and (b := base.get(r["concurrency"]))
    ]


def print_report(args, rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    table = Table(
        title=f"LoRA: {meta['model']} ({meta['dtype']}, quant {','.join(meta['quant'])}), "
        f"{args.adapters} adapters of rank {args.lora_rank}, {args.max_tokens} tokens a stream, "
        f"medians of {args.lora_rounds} rounds, "
        f"{meta['cpu_count']} CPUs, commit {meta['commit']}"
    )
    for column in ("wave", "N", "tok/s", "per stream", "step ms", "TTFT p50 ms", "other CPU %"):
        table.add_column(column, justify="left" if column == "wave" else "right")
    for r in rows:
        table.add_row(
            r["setting"],
            str(r["concurrency"]),
            fmt(r["aggregate_tok_s"], 1),
            fmt(r["per_stream_tok_s"], 1),
            fmt(r["step_ms"], 1),
            fmt(r["ttft_p50_ms"], 0),
            fmt(r["other_cpu_pct"], 0),
        )
    console.print(table)
    for r in ratios(rows):
        console.print(f"{r['name']} at N={r['concurrency']}: {r['value']:.2f}")
