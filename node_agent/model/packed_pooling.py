"""Padding-free passes for embedding models on a CPU: a pass's inputs go into one row, one after
another, each with its own positions from 0, and every attention layer runs SDPA over each input's
own span (causal for a decoder, bidirectional for an encoder), so no token attends across inputs
and no pad token is computed (vLLM's flattened batch, without its varlen kernels). The Linear
layers, which cost the most, see only real tokens.

It works for a model whose attention goes through transformers' attention interface and passes
the forward's keyword arguments down to it (BERT, XLM-R, Qwen3 …). `enable` checks that on the
loaded model: two inputs packed must pool as they do padded, else the model keeps padded passes.
On a GPU the per-input attention calls would cost more than the padding saves; there the passes
are padded (sorted by length) too."""

import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from node_agent.model import pooling
from node_agent.model.pooling import LoadedPooler, PoolingMode

log = logging.getLogger(__name__)

NAME = "cortex_packed_pooling"
_PROBE = ["The capital of France is Paris, a city of light.", "Hello!"]


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    spans: list[tuple[int, int]] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: with `spans` (a packed row's inputs, [start, end) each),
    SDPA over each span on its own; without, SDPA over the whole (a padded pass)."""
    if spans is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    parts = [
        sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            None,
            scaling=scaling,
            dropout=dropout,
            **kwargs,
        )[0]
        for start, end in spans
    ]
    return torch.cat(parts, dim=1), None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # a padded pass gets SDPA's masks


def enable(loaded: LoadedPooler) -> bool:
    """Run the model's attention through `attention` and check two inputs pool packed as they do
    padded; False (the model as it was, the reason logged) where they do not, or it cannot."""
    config = loaded.model.config
    if (
        loaded.pooling is None
        or loaded.device.type != "cpu"
        or config._attn_implementation != "sdpa"
    ):
        return False
    rows = [ids[: loaded.max_len] for ids in loaded.tokenizer(_PROBE)["input_ids"]]
    config._attn_implementation = NAME
    try:
        same = torch.allclose(
            forward(loaded, rows),
            pooling.forward(loaded, rows, None),
            atol=1e-4 if loaded.model.dtype == torch.float32 else 5e-2,
        )
    except Exception as exc:  # a model that does not take positions or keyword arguments this way
        log.info(
            "%s: passes stay padded (packing failed: %s: %s)",
            config.model_type,
            type(exc).__name__,
            exc,
        )
        same = False
    if not same:
        config._attn_implementation = "sdpa"
    return same


def _pool(
    hidden: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, mode: PoolingMode
) -> torch.Tensor:
    if mode == "cls":
        return hidden[starts]
    if mode == "lasttoken":
        return hidden[starts + lengths - 1]
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
    sums = torch.zeros((len(lengths), hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device)
    return sums.index_add_(0, owner, hidden) / lengths[:, None].to(hidden.dtype)


@torch.inference_mode()
def forward(loaded: LoadedPooler, rows: list[list[int]]) -> torch.Tensor:
    """One forward over `rows` packed into one: each row's pooled vector (float32)."""
    lengths = torch.tensor([len(row) for row in rows], device=loaded.device)
    starts = torch.cumsum(lengths, 0) - lengths
    spans = [(start, start + len(row)) for start, row in zip(starts.tolist(), rows)]
    ids = torch.tensor([[token for row in rows for token in row]], device=loaded.device)
    positions = torch.cat([torch.arange(len(row)) for row in rows])[None].to(loaded.device)
    hidden = loaded.model(input_ids=ids, position_ids=positions, spans=spans).last_hidden_state[0]
    return _pool(hidden, starts, lengths, loaded.pooling.mode).float()
