"""What a float8 Linear layer costs a decode step on a GPU, against bfloat16's: the seven projections
of a Qwen3-8B-shaped layer (hidden 4096, intermediate 12288, 8 KV heads of 128) for 36 layers, each
with its own weights (nothing stays in L2), captured in one CUDA graph as a decode step is, and
replayed; µs a call at 1 and 64 rows. Beside `Float8Linear` as the node runs it, the ways of scaling
its input that docs/benchmarks.md weighs: in eager torch's fewest kernels (today's layer), one
scale for the whole input (cuBLAS's per-tensor FP8 matmul, then the channels' scales), and the
row scaling compiled into one kernel (torch.compile).
  python scripts/profile_fp8_linear.py            # on a GPU with FP8 matmuls (compute capability 8.9+)
  python scripts/profile_fp8_linear.py --cpu      # tiny shapes, no graphs: checks that it runs"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from node_agent.model.quantized_linear import COMPUTE_DTYPE, FP8, FP8_MAX, Float8Linear  # noqa: E402

TINY = torch.finfo(torch.float32).tiny


def rows_scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    largest = x.abs().amax(-1, keepdim=True).float().clamp(min=TINY)
    return (x * (FP8_MAX / largest)).to(FP8), largest


def variants(device: str) -> dict:
    compiled = torch.compile(rows_scaled, dynamic=False, fullgraph=True)
    one = torch.ones((), device=device)

    def compiled_rows(layer: Float8Linear, x: torch.Tensor) -> torch.Tensor:
        codes, largest = compiled(x)
        return torch._scaled_mm(
            codes,
            layer.weight_fp8.t(),
            scale_a=largest,
            scale_b=layer.weight_scale,
            out_dtype=COMPUTE_DTYPE,
        )

    def per_tensor(layer: Float8Linear, x: torch.Tensor) -> torch.Tensor:
        largest = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32).clamp(min=TINY)
        codes = (x * (FP8_MAX / largest)).to(FP8)
        y = torch._scaled_mm(
            codes, layer.weight_fp8.t(), scale_a=largest, scale_b=one, out_dtype=COMPUTE_DTYPE
        )
        return y * layer.weight_scale

    return {
        "bf16 F.linear": lambda layer, weight, x: F.linear(x, weight),
        "Float8Linear": lambda layer, weight, x: layer(x),
        "float8, one scale for the input": lambda layer, weight, x: per_tensor(layer, x),
        "float8, row scaling compiled": lambda layer, weight, x: compiled_rows(layer, x),
    }


def timed_ms(chain, device: str) -> float:
    for _ in range(3):
        chain()
    if device != "cuda":
        t0 = time.perf_counter()
        chain()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(30):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 30 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu", action="store_true", help="tiny shapes on the CPU (torch 2.12+ for per-row scales)"
    )
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    hidden, intermediate, kv, layers = (256, 512, 64, 2) if args.cpu else (4096, 12288, 1024, 36)
    shapes = [
        (hidden, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, hidden),
        (intermediate, hidden),
        (intermediate, hidden),
        (hidden, intermediate),
    ]  # (out, in): q k v o gate up down
    torch.manual_seed(0)
    dense = [
        [torch.randn(o, i, device=device, dtype=COMPUTE_DTYPE) * 0.02 for o, i in shapes]
        for _ in range(layers)
    ]
    fp8 = [[Float8Linear.quantize(w) for w in layer] for layer in dense]
    calls = layers * len(shapes)
    for rows in (1, 64):
        inputs = {
            n: torch.randn(rows, n, device=device, dtype=COMPUTE_DTYPE)
            for n in (hidden, intermediate)
        }
        for name, call in variants(device).items():

            def chain():
                for quantized, weights in zip(fp8, dense):
                    for layer, weight in zip(quantized, weights):
                        call(layer, weight, inputs[weight.shape[1]])

            ms = timed_ms(chain, device)
            print(
                f"rows {rows:3d}  {name:34s} {ms:8.3f} ms for {calls} calls ({ms / calls * 1e3:6.1f} µs each)",
                flush=True,
            )


if __name__ == "__main__":
    main()
