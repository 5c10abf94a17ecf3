"""Per-op time of the engine's forwards on fixed shapes (torch.profiler), for issue 31's profile:
a 512-token prefill chunk at 0 and 2k tokens of context, and decode steps of N rows at a short and
a 2k context. The forwards are the engine's own (node_agent/model/forward.py over the paged cache,
the model loaded by node_agent/model/loader.py, so with the same packing and layout as a node);
each row's blocks are scattered over the pool as a long-running node's are.

    scripts/profile-engine                    # the default model, float32, 1 torch thread
    scripts/profile-engine --threads 2 --dtype bfloat16 --top 8
    scripts/profile-engine --shape qwen3-0.6b # a random model in a real shape (scripts/bench_models.py)

Prints, for each case, the mean time of a few runs and the ops that took most of one run's time.
Times are this machine's; compare cases and runs made here, one after another, on a quiet machine."""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from node_agent.model import forward, loader  # noqa: E402
from node_agent.model.kv_cache import PagedCache  # noqa: E402
from shared.catalog import Catalog  # noqa: E402

CONTEXT = 2048
CHUNK = 512


def load(args):
    profile = Catalog.load(None).resolve("default")
    if args.shape:
        import bench_models

        profile = profile.model_copy(
            update={
                "source": str(bench_models.build(args.shape, args.dtype, "cpu", None)),
                "gguf_file": None,
                "tokenizer_source": None,
            }
        )
    profile = profile.model_copy(
        update={
            "dtype": args.dtype,
            "quant": args.quant,
            "slots": args.rows,
            "max_model_len": 2 * CONTEXT,
        }
    )
    return loader.load(profile, "cpu")


def scattered_cache(lm, rows: int, block_size: int = 16) -> PagedCache:
    """A cache of `rows` rows of CONTEXT + CHUNK positions each, their blocks in random order."""
    per_row = (CONTEXT + CHUNK) // block_size
    cache = PagedCache.for_model(
        lm.model.config.get_text_config(),
        slots=rows,
        max_len=2 * CONTEXT,
        blocks=rows * per_row,
        block_size=block_size,
        dtype=lm.dtype,
        device=lm.device,
    )
    cache.block_tables[:, :per_row] = (torch.randperm(rows * per_row) + 1).view(rows, per_row)
    return cache


def cases(lm, cache: PagedCache, rows: int):
    def prefill(start: int):
        ids, positions = (
            torch.randint(0, 1000, (1, CHUNK)),
            torch.arange(start, start + CHUNK)[None],
        )
        return lambda: forward.forward(
            lm.model, cache, slice(0, 1), ids, positions, positions, start + CHUNK
        )

    def decode(n: int, context: int):
        tokens, positions = torch.randint(0, 1000, (n,)), torch.full((n,), context)
        offsets = torch.zeros(n, dtype=torch.long)
        return lambda: forward.decode_step(
            lm.model, cache, tokens, positions, offsets, context + 32
        )

    yield f"prefill {CHUNK} tokens at 0", prefill(0)
    yield f"prefill {CHUNK} tokens at {CONTEXT}", prefill(CONTEXT)
    for n in sorted({1, 8, rows}):
        yield f"decode N={n} at 128", decode(n, 128)
    for n in sorted({8, rows}):
        yield f"decode N={n} at {CONTEXT}", decode(n, CONTEXT)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (a 2-core node runs 1; default 1)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--quant",
        default="none",
        help="the catalogue's `quant` (default none: float32 weights, as "
        "scripts/bench's Cortex rows; auto: the GGUF's as stored)",
    )
    p.add_argument(
        "--shape", default=None, help="a random model in this shape instead of the default model"
    )
    p.add_argument("--rows", type=int, default=32, help="the widest decode batch (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs a case (default 3)")
    p.add_argument("--top", type=int, default=6, help="ops listed a case (default 6)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lm = load(args)
    cache = scattered_cache(lm, args.rows)
    print(
        f"{args.shape or 'default model'} {args.dtype}, {args.threads} torch thread(s), torch {torch.__version__}"
    )
    with torch.inference_mode():
        for name, run in cases(lm, cache, args.rows):
            run()
            started = time.perf_counter()
            for _ in range(args.repeats):
                run()
            ms = (time.perf_counter() - started) / args.repeats * 1000
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
            ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            total = sum(e.self_cpu_time_total for e in ops) or 1
            top = ", ".join(
                f"{e.key.removeprefix('aten::')} {100 * e.self_cpu_time_total / total:.0f}%"
                for e in ops[: args.top]
            )
            print(f"{name:>24}: {ms:8.1f} ms | {top}", flush=True)


if __name__ == "__main__":
    main()
