"""The model's forward over the slot cache, as small pure functions (gpt-fast's manner).

`decode_step` is the fixed-shape step: one token for each of B rows, B and `kv_len` fixed by the
caller's buckets, every input a tensor, the attention mask built on the device from the rows'
positions. It has no host sync and no data-dependent Python, so it runs eagerly, compiles with
`torch.compile(fullgraph=True)` and is captured in a CUDA graph (node_agent/graphs.py) unchanged.
Prefill uses `forward` with chunks of any width.
"""

import torch

from node_agent.kv_cache import SlotKVCache


def attention_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, 1, T, kv_len] bool: query at position p sees cache columns 0..p."""
    columns = torch.arange(kv_len, device=positions.device)
    return (columns[None, None, :] <= positions[:, :, None])[:, None]


def forward(model: torch.nn.Module, cache: SlotKVCache, rows: slice, input_ids: torch.Tensor,
            positions: torch.Tensor, write_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Run cache rows `rows` over `input_ids` [B, T] at `positions`, writing keys/values at
    `write_pos`; returns the last hidden states [B, T, H]."""
    cache.bind(rows, write_pos, kv_len)
    out = model.get_decoder()(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask(positions, kv_len),
                              past_key_values=cache, use_cache=True)
    return out.last_hidden_state


def logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits for hidden states [..., H]."""
    return model.get_output_embeddings()(hidden).float()


def decode_step(model: torch.nn.Module, cache: SlotKVCache, tokens: torch.Tensor, positions: torch.Tensor,
                kv_len: int) -> torch.Tensor:
    """One token for each of rows 0..B-1: `tokens` and `positions` are [B]; each row writes its
    cache column `positions[b]` (the scratch column for padding rows). Returns logits [B, V]."""
    positions = positions[:, None]
    hidden = forward(model, cache, slice(0, tokens.shape[0]), tokens[:, None], positions, positions, kv_len)
    return logits(model, hidden[:, -1])
