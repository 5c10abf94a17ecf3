"""A CPU model's decode step compiled, with Inductor's caches kept on disk (vLLM-CPU compiles its step too).

Eager, a decode step of the default model is ~4,600 ATen calls from Python (norms, rotary, views,
cache writes, residual adds between the matmuls): at one row on a 2-vCPU AVX2 host ~40 % of the
step. `torch.compile` of `forward.decode_step` with the packed matmul
(node_agent/model/packed_linear.py) and the paged decode attention (node_agent/model/cpu_attention.py)
as opaque operators fuses the rest into a few C++ kernels: 44 → 28 ms a step at one row, 71 → 44 at
8, 118 → 98 at 32 there, the logits within float rounding of eager (docs/benchmarks.md).

One graph serves every batch size and cache length (dynamic shapes; a single row runs padded to
two, with a padding row that writes the scratch position as a static decoder's do). It is compiled
at load, by a step of two padding rows: a minute or two on a small CPU the first time, then
Inductor's caches (its compiled kernels and graphs, under the node's `compile_cache` folder unless
TORCHINDUCTOR_CACHE_DIR is set) leave only the trace to redo (~15 s for the default model). Where it
cannot compile (any error), the step runs eagerly and a log line says why; a model with 8-bit
layers (torch's dynamic int8 quantizes a whole batch's activations) or linear attention (per-step
Python state) runs eagerly. 4-bit layers are opaque to Inductor as the packed matmul is (the node's
`cortex::int4_linear` where the model is bound to it, node_agent/model/int4_tiles.py; else
`cortex::int4_matmul`, node_agent/model/quantized_linear.py), and so is an output head read as
8-bit groups (node_agent/model/int8_groups_cpu.py), so their numbers stay the eager ones.

Dynamo checks no guards on the model's modules before each call (`skip_guard_on_all_nn_modules_unsafe`):
a replica's model is not changed after load (adapters are written into slots in place), and those
guards, some 2,500 for the default model, took 1.3 ms of a 15 ms step at one row.
"""

import logging
import os
import time
import types
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from node_agent.model import forward, quantized_linear
from node_agent.model.kv_cache import PagedCache

log = logging.getLogger(__name__)


def why_not(model: torch.nn.Module, cache: PagedCache) -> str | None:
    """Why this model's decode step is not compiled on a CPU (None: it is)."""
    if cache.device.type != "cpu":
        return "not a CPU model"
    if not forward.reads_in_place(model):
        return "its attention does not read the paged cache in place (the CPU kernels are not built, or it needs eager attention)"
    if cache.has_linear_attention:
        return "it has linear-attention layers"
    if any(
        type(m).__module__ == quantized_linear.__name__
        and not isinstance(m, quantized_linear.Int4Linear)
        for m in model.modules()
    ):
        return "it has 8-bit or FP8 layers (their kernels run eagerly)"
    if cache.block_tables.shape[0] < 2:
        return "one slot (a single row runs padded to two)"
    return None


class CompiledStep:
    """`forward.decode_step` under torch.compile, one graph for any batch size and cache length."""

    def __init__(self):
        step = (
            forward.decode_step
        )  # a copy with its own code object: torch.compile keeps its graphs on the code
        # object, so each replica's are its own (and go with it) rather than piling up on one (8 at most)
        own = types.FunctionType(
            step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__
        )
        self.compiled = torch.compile(
            own,
            fullgraph=True,
            dynamic=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )
        self.eager = False  # set once a call could not be compiled: every step after runs eagerly

    def __call__(
        self,
        model: torch.nn.Module,
        cache: PagedCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rope_offsets: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        if not self.eager:
            try:
                return self._padded(model, cache, tokens, positions, rope_offsets, kv_len)
            except (
                torch._dynamo.exc.TorchDynamoException,
                torch._dynamo.exc.FailOnRecompileLimitHit,
            ) as exc:
                # a call that needed another graph and could not have one (raised while tracing: nothing ran)
                log.warning(
                    "the compiled decode step failed (%s); decoding eagerly from now on", _said(exc)
                )
                self.eager = True
        return forward.decode_step(model, cache, tokens, positions, rope_offsets, kv_len)

    def _padded(
        self,
        model: torch.nn.Module,
        cache: PagedCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rope_offsets: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        if (
            tokens.shape[0] > 1
        ):  # the offsets (a view of the engine's) as a tensor made here like the others,
            # so that guards on how tensors were made pass for every call
            return self._run(model, cache, tokens, positions, rope_offsets.clone(), kv_len)
        pad = tokens.new_zeros(
            1
        )  # a padding row: token 0 written at the scratch position (the null block)
        return self._run(
            model,
            cache,
            torch.cat([tokens, pad]),
            torch.cat([positions, pad + cache.scratch_position]),
            torch.cat([rope_offsets, pad]),
            kv_len,
        )[:1]

    def _run(self, *args) -> torch.Tensor:
        # floats (norms' eps) as constants: as symbols they cost a second trace; no duck sizing: a batch of as
        # many rows as some dimension of the model would be taken for that dimension, and compiled again
        with (
            torch._dynamo.config.patch(specialize_float=True),
            torch.fx.experimental._config.patch(use_duck_shape=False),
        ):
            return self.compiled(*args)


def load(model: torch.nn.Module, cache: PagedCache, folder: Path | None) -> CompiledStep | None:
    """The model's decode step compiled (now, by a step of two padding rows), with Inductor's caches
    in `folder` (unless TORCHINDUCTOR_CACHE_DIR is set; None: torch's default, a temporary folder).
    None (the step runs eagerly) where it cannot be, with the reason logged."""
    reason = why_not(model, cache)
    if reason is not None:
        log.info("decode steps run eagerly: %s", reason)
        return None
    if folder is not None and os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (
        None,
        default_cache_dir(),
    ):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
            folder / "inductor"
        )  # not the user's choice (torch sets its
        # default there once it has looked); /tmp may not outlive a restart
    caches = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    refusal = _cache_refusal(caches, folder)
    if refusal:
        log.warning("decode steps run eagerly: %s", refusal)
        return None
    log.info(
        "compiling the decode step (a minute or two on a small CPU the first time; Inductor's caches in %s)",
        os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir(),
    )
    started = time.perf_counter()
    step = CompiledStep()
    try:
        with torch.inference_mode():  # as the runner's steps run
            padding = torch.zeros(2, dtype=torch.long, device=cache.device)
            step._padded(
                model,
                cache,
                padding,
                padding + cache.scratch_position,
                padding,
                2 * cache.block_size,
            )
    except Exception as exc:
        log.warning("decode steps run eagerly: compiling the step failed (%s)", _said(exc))
        return None
    log.info("decode step compiled in %.1f s", time.perf_counter() - started)
    return step


def _cache_refusal(caches: Path, setting: Path | None) -> str:
    """Why Inductor must not use `caches` (it loads and runs the code kept there): it, or the
    `compile_cache` folder holding it, is owned by another user or writable by its group or others.
    A folder that is not there yet is made for this user alone. "" when it may."""
    try:
        caches.mkdir(parents=True, exist_ok=True, mode=0o700)
        holders = [setting] if setting is not None and caches.is_relative_to(setting) else []
        for folder in [*holders, caches]:
            stat = folder.stat()
            if stat.st_uid != os.geteuid():
                return (
                    f"the compile cache {folder} is owned by uid {stat.st_uid}, not this node's "
                    f"user ({os.geteuid()}); chown it, or set another compile_cache"
                )
            if stat.st_mode & 0o022:
                return (
                    f"the compile cache {folder} is writable by its group or others (mode "
                    f"{stat.st_mode & 0o777:o}); chmod go-w it, or set another compile_cache"
                )
    except OSError as exc:
        return f"the compile cache {caches} cannot be used: {exc}"
    return ""


def _said(exc: Exception) -> str:
    """An exception's type and the first line of its message (torch's run to pages)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
