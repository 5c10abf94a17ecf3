"""How the engine runs `forward.decode_step`: eagerly on exactly the running rows, or with rows
padded to a bucket of batch sizes and static input buffers, captured in one CUDA graph per
(batch bucket, cache-length bucket) on GPUs, optionally compiled first. Each takes the rows'
last tokens and positions and returns their logits; everything else stays in the engine.

The static decoder also runs speculation's verify step (`forward.verify_step`: a row's last token
and its draft tokens) over rows padded to a batch bucket and a width bucket, captured per (batch,
width, cache length) like the decode step: a speculating step on a GPU replays a graph too.
"""

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from node_agent.model import compiled_step, forward
from node_agent.model.kv_cache import PagedCache

log = logging.getLogger(__name__)


class CaptureFailed(RuntimeError):
    """The step could not be captured (or compiled) for a bucket; the engine falls back to eager."""


EAGER_KV_ROUND = 32  # eager steps attend over cache columns rounded up to this
MIN_KV_BUCKET = 128  # static steps attend over a power of two of at least this many columns
WIDTH_BUCKETS = (
    2,
    4,
    8,
    16,
    32,
    64,
    128,
)  # verify steps score a power of two of tokens a row (a row's token + its drafts)


def batch_buckets(slots: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, and `slots` itself."""
    sizes = {b for b in (1, 2, 4, 8) if b < slots} | set(range(8, slots, 8)) | {slots}
    return sorted(sizes)


def bucket(sizes: list[int], needed: int) -> int:
    return next(size for size in sizes if size >= needed)


def kv_buckets(max_len: int) -> list[int]:
    sizes, size = [], MIN_KV_BUCKET
    while size < max_len:
        sizes.append(size)
        size *= 2
    return sizes + [max_len]


class EagerDecoder:
    """The step on exactly the running rows (CPU, or a model that cannot be captured)."""

    graph_bytes = 0
    verifies = False  # speculation's verify step runs as the runner's padded forward

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedCache,
        rope_offsets: torch.Tensor,
        step: Callable = forward.decode_step,
        name: str = "eager",
    ):
        self.model, self.cache, self.rope_offsets, self.step, self.name = (
            model,
            cache,
            rope_offsets,
            step,
            name,
        )

    def __call__(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        device = self.cache.device
        inputs = torch.tensor([tokens, positions], device=device)
        kv_len = min(
            -(-(max(positions) + 1) // EAGER_KV_ROUND) * EAGER_KV_ROUND, self.cache.max_len
        )
        return self.step(
            self.model, self.cache, inputs[0], inputs[1], self.rope_offsets[: len(tokens)], kv_len
        )


class StaticDecoder:
    """The step over rows padded to a batch bucket, from static buffers filled by one copy.
    Padding rows write the cache's scratch position (and keep their linear-attention state) and
    their logits are dropped. With `capture` (CUDA), each (batch, kv) bucket is captured in a CUDA
    graph at first use and replayed after."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: PagedCache,
        rope_offsets: torch.Tensor,
        slots: int,
        *,
        capture: bool,
        step: Callable = forward.decode_step,
        verifies: bool = True,
    ):
        self.model, self.cache, self.rope_offsets, self.step, self.capture = (
            model,
            cache,
            rope_offsets,
            step,
            capture,
        )
        self.verifies = verifies  # runs the verify step too (not a tensor-parallel model's: its ranks run each forward)
        self.name = "cuda-graphs" if capture else "static"
        self.batch_sizes, self.kv_sizes = batch_buckets(slots), kv_buckets(cache.max_len)
        device = cache.device
        self.inputs = torch.zeros(2, slots, dtype=torch.long, device=device)  # tokens, positions
        self.staging = torch.zeros(2, slots, dtype=torch.long, pin_memory=device.type == "cuda")
        self.wide: torch.Tensor | None = (
            None  # the verify step's tokens, positions, write positions [3, slots, W]
        )
        self.wide_staging: torch.Tensor | None = None
        self.graphs: dict[
            tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]
        ] = {}  # (batch, [width,] kv)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_s = 0.0
        self.graph_bytes = 0  # device memory the captured graphs' pool took

    def __call__(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        n = len(tokens)
        batch, kv_len = bucket(self.batch_sizes, n), bucket(self.kv_sizes, max(positions) + 1)
        self.staging[:, :n] = torch.tensor([tokens, positions])
        self.staging[0, n:batch] = 0
        self.staging[1, n:batch] = self.cache.scratch_position
        self.inputs[:, :batch].copy_(self.staging[:, :batch], non_blocking=True)
        return self._replay((batch, kv_len), lambda: self._run(batch, kv_len))[:n]

    def verify(self, rows: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Each row's tokens (its last token, then its drafts) from its position in `starts`: their
        logits [rows, width, V] (a shorter row's padding at the end of its own)."""
        n, width = len(rows), bucket(list(WIDTH_BUCKETS), max(len(tokens) for tokens in rows))
        batch = bucket(self.batch_sizes, n)
        kv_len = bucket(
            self.kv_sizes, min(max(s + len(t) for t, s in zip(rows, starts)), self.cache.max_len)
        )
        if self.wide is None or self.wide.shape[2] < width:
            slots = self.inputs.shape[1]
            self.wide = torch.zeros(3, slots, width, dtype=torch.long, device=self.cache.device)
            self.wide_staging = torch.zeros(
                3, slots, width, dtype=torch.long, pin_memory=self.capture
            )
            self.graphs = {
                key: graph for key, graph in self.graphs.items() if len(key) == 2
            }  # read the old buffer
        staging = self.wide_staging[:, :batch, :width]
        forward.padded_inputs(
            list(zip(rows, starts)), staging, self.cache.scratch_position, self.cache.max_len
        )
        self.wide[:, :batch, :width].copy_(staging, non_blocking=True)
        return self._replay((batch, width, kv_len), lambda: self._run_verify(batch, width, kv_len))[
            :n
        ]

    def _replay(self, key: tuple[int, ...], run: Callable[[], torch.Tensor]) -> torch.Tensor:
        if not self.capture:
            return run()
        graph = self.graphs.get(key) or self._capture(key, run)
        graph[0].replay()
        return graph[1]

    def _run(self, batch: int, kv_len: int) -> torch.Tensor:
        return self.step(
            self.model,
            self.cache,
            self.inputs[0, :batch],
            self.inputs[1, :batch],
            self.rope_offsets[:batch],
            kv_len,
        )

    def _run_verify(self, batch: int, width: int, kv_len: int) -> torch.Tensor:
        tokens, positions, write_pos = self.wide[:, :batch, :width]
        return forward.verify_step(
            self.model, self.cache, tokens, positions, write_pos, self.rope_offsets[:batch], kv_len
        )

    def _capture(
        self, key: tuple[int, ...], run: Callable[[], torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream, then capture. The warm-up runs write the same cache columns
        with the same values as the replay that follows, so they change nothing there; they do
        move linear-attention states on, which are put back before the replay."""
        started, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        states = self.cache.linear_states()
        saved = [state.clone() for state in states]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    run()
            torch.cuda.current_stream().wait_stream(side)
            _put_back(states, saved)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = run()
        except Exception as exc:
            torch.cuda.synchronize()
            _put_back(states, saved)
            raise CaptureFailed(f"{type(exc).__name__}: {exc}") from exc
        self.graphs[key] = (graph, out)
        elapsed = time.perf_counter() - started
        self.capture_s += elapsed
        self.graph_bytes += max(torch.cuda.memory_reserved() - reserved, 0)
        shape = " x ".join(
            f"{size} {what}"
            for size, what in zip(
                key,
                ("rows", "tokens", "cache columns") if len(key) == 3 else ("rows", "cache columns"),
            )
        )
        log.info(
            "captured the %s step for %s in %.0f ms (%d graphs, %.1f s and %d MiB in all)",
            "verify" if len(key) == 3 else "decode",
            shape,
            elapsed * 1000,
            len(self.graphs),
            self.capture_s,
            self.graph_bytes >> 20,
        )
        return self.graphs[key]


def _put_back(states: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    for state, copy in zip(states, saved):
        state.copy_(copy)


def gpu_compiled_step() -> Callable:
    """`decode_step` under torch.compile (fullgraph: no host sync, no graph break), to be captured."""
    return torch.compile(forward.decode_step, fullgraph=True, dynamic=True)


def make(
    mode: str,
    model: torch.nn.Module,
    cache: PagedCache,
    rope_offsets: torch.Tensor,
    slots: int,
    fixed_step: Callable | None = None,
    compile_cache: Path | None = None,
) -> EagerDecoder | StaticDecoder:
    """`mode`: auto (CUDA graphs on a GPU; on a CPU the step compiled where there is a
    `compile_cache` folder for Inductor's caches, node_agent/model/compiled_step.py, else eager),
    eager, static, graphs, compiled (on a GPU compiled, then captured; on a CPU compiled at load). `rope_offsets`: the engine's per-slot rotary offsets, read
    in place by every step (rows 0..B-1). A `fixed_step` (a tensor-parallel model's, which sends
    each step to its other ranks) runs as it is: eagerly on a CPU, padded to buckets on a GPU,
    never compiled or captured."""
    cuda = cache.device.type == "cuda"
    if fixed_step is not None:
        return (
            StaticDecoder(
                model, cache, rope_offsets, slots, capture=False, step=fixed_step, verifies=False
            )
            if cuda
            else EagerDecoder(model, cache, rope_offsets, fixed_step)
        )
    if mode == "auto":
        mode = "graphs" if cuda else "compiled" if compile_cache is not None else "eager"
    if not cuda and mode == "compiled":
        step = compiled_step.load(model, cache, compile_cache)
        return (
            EagerDecoder(model, cache, rope_offsets, step, "compiled")
            if step is not None
            else EagerDecoder(model, cache, rope_offsets)
        )
    step = gpu_compiled_step() if mode == "compiled" else forward.decode_step
    if mode == "eager":
        return EagerDecoder(model, cache, rope_offsets, step)
    if mode == "graphs" and not cuda:
        raise ValueError("decode = 'graphs' needs a CUDA device")
    return StaticDecoder(model, cache, rope_offsets, slots, capture=cuda, step=step)
