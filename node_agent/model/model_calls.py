"""Every call the engine's runner makes into its model and cache, in one place: a prefill forward,
logits for some hidden states, the fixed-shape decode step, setting the rows' block tables and
moving a row's state. On one device they run the pure functions of node_agent/model/forward.py
directly; a tensor-parallel model (node_agent/tp/tensor_parallel.py) sends each one to its other
ranks first, so every rank runs the same calls in the same order.

The cache's size (`kv_blocks`): the profile's `kv_cache_mb` of keys and values; else its
`kv_memory_fraction` of the memory the device has free once the weights are loaded (vLLM's
`gpu_memory_utilization`); else `DEFAULT_KV_CACHE_MB`, capped at `slots` sequences of
`max_model_len` tokens and never below one (shared/memory.py `default_kv_blocks`, which the
placement estimate there follows too)."""

from collections.abc import Callable

import torch

from node_agent.model import devices, forward
from node_agent.model.kv_cache import PackedChunk, PagedCache, bytes_per_token
from node_agent.model.loader import LoadedModel
from shared.catalog import ModelProfile
from shared.memory import default_kv_blocks
from shared.model_files import ModelLoadError

_MB = 1 << 20


def context_length(loaded: LoadedModel, profile: ModelProfile) -> int:
    return profile.effective_context(loaded.context_len)[0]


def kv_blocks(loaded: LoadedModel, profile: ModelProfile) -> int:
    """How many blocks the paged cache holds (every rank of a tensor-parallel model as many)."""
    config, max_len = loaded.model.config.get_text_config(), context_length(loaded, profile)
    block_bytes = bytes_per_token(config, max_len, loaded.dtype.itemsize) * profile.block_size
    if not block_bytes:  # no attention layer reads keys: one block per row keeps the tables valid
        return profile.slots
    if profile.kv_cache_mb is not None:
        blocks = profile.kv_cache_mb * _MB // block_bytes
    elif profile.kv_memory_fraction is not None:
        free_mb = devices.describe(
            str(loaded.device) if loaded.device.type == "cuda" else "cpu"
        ).free_mb
        blocks = int(free_mb * _MB * profile.kv_memory_fraction) // (
            block_bytes // loaded.tp_size or 1
        )
    else:
        blocks = default_kv_blocks(profile, block_bytes=block_bytes, max_len=max_len)
    if blocks < 1:
        raise ModelLoadError(
            f"{profile.id}: a KV budget of {profile.kv_cache_mb} MB holds no block of "
            f"{profile.block_size} tokens ({block_bytes} bytes each)"
        )
    return blocks


def paged_cache(loaded: LoadedModel, profile: ModelProfile) -> PagedCache:
    """The model's paged cache; under tensor parallelism each rank holds its share of the KV heads."""
    return PagedCache.for_model(
        loaded.model.config.get_text_config(),
        slots=profile.slots,
        max_len=context_length(loaded, profile),
        blocks=kv_blocks(loaded, profile),
        block_size=profile.block_size,
        dtype=loaded.dtype,
        device=loaded.device,
        ranks=loaded.tp_size,
    )


def weight_bytes(model: torch.nn.Module) -> int:
    """What the model's weights take on this device (a tensor-parallel rank's own shards)."""
    tensors = [getattr(t, "to_local", lambda t=t: t)() for t in model.state_dict().values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class ModelCalls:
    """The model calls of one device."""

    step: Callable | None = (
        None  # a decode step the decoder must run as it is (None: its own choice)
    )

    def __init__(self, model: torch.nn.Module, cache: PagedCache):
        self.model, self.cache = model, cache

    def forward(
        self,
        rows: slice,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_pos: torch.Tensor,
        kv_len: int,
        **vision: torch.Tensor | None,
    ) -> torch.Tensor:
        """A prefill forward; `vision`: a chunk group's `inputs_embeds`, `rope_positions` and
        `sees_until` where it reads images (node_agent/model/forward.py)."""
        return forward.forward(
            self.model, self.cache, rows, input_ids, positions, write_pos, kv_len, **vision
        )

    @property
    def packs(self) -> bool:
        """Whether decode rows and prefill chunks can run as one forward (`packed_forward`): a model
        whose attention reads the cache in place, with no linear-attention state (kept per row)."""
        return forward.reads_in_place(self.model) and not self.cache.has_linear_attention

    def packed_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        decode_rows: torch.Tensor,
        chunks: list[PackedChunk],
    ) -> torch.Tensor:
        return forward.packed_forward(
            self.model, self.cache, tokens, positions, decode_rows, chunks
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return forward.logits(self.model, hidden)

    def set_tables(self, tables: torch.Tensor) -> None:
        """Rows 0..n-1's block tables ([n, max_blocks] int64, host memory)."""
        self.cache.set_tables(tables)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)

    def close(self) -> None:
        """Release what the calls hold beyond tensors (other ranks)."""
