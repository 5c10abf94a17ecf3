"""Every call the engine makes into its model and cache, in one place: a prefill forward, logits
for some hidden states, the fixed-shape decode step, and moving a cache row. On one device they
run the pure functions of node_agent/model/forward.py directly; a tensor-parallel model
(node_agent/tp/tensor_parallel.py) sends each one to its other ranks first, so every rank runs the
same calls in the same order."""

from collections.abc import Callable

import torch

from node_agent.model import forward
from node_agent.model.kv_cache import SlotCache
from node_agent.model.loader import LoadedModel
from shared.catalog import ModelProfile


def slot_cache(loaded: LoadedModel, profile: ModelProfile) -> SlotCache:
    """The model's slot cache; under tensor parallelism each rank holds its share of the KV heads."""
    return SlotCache.for_model(loaded.model.config.get_text_config(), slots=profile.slots,
                               max_len=min(profile.max_model_len, loaded.context_len),
                               prefill_chunk_tokens=profile.prefill_chunk_tokens, dtype=loaded.dtype,
                               device=loaded.device, ranks=loaded.tp_size)


def weight_bytes(model: torch.nn.Module) -> int:
    """What the model's weights take on this device (a tensor-parallel rank's own shards)."""
    tensors = [getattr(t, "to_local", lambda t=t: t)() for t in model.state_dict().values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class ModelCalls:
    """The model calls of one device."""

    step: Callable | None = None  # a decode step the decoder must run as it is (None: its own choice)

    def __init__(self, model: torch.nn.Module, cache: SlotCache):
        self.model, self.cache = model, cache

    def forward(self, rows: slice, input_ids: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor,
                kv_len: int, **vision: torch.Tensor | None) -> torch.Tensor:
        """A prefill forward; `vision`: a chunk group's `inputs_embeds`, `rope_positions` and
        `sees_until` where it reads images (node_agent/model/forward.py)."""
        return forward.forward(self.model, self.cache, rows, input_ids, positions, write_pos, kv_len, **vision)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return forward.logits(self.model, hidden)

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.cache.move_row(src, dst, length)

    def close(self) -> None:
        """Release what the calls hold beyond tensors (other ranks)."""
