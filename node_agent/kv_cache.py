"""A static KV cache with one row per slot, plugged into transformers models as their cache.

Active sequences occupy rows 0..n-1 (the engine keeps them packed), so a forward over rows
[a, b) reads views of the cache, never gathers. Each row writes at its own columns, given as a
tensor (`bind`), which HF's StaticCache (one position vector for the whole batch) cannot do.
Column `max_len` is a scratch column: padding (of a prefill chunk, or the rows a decode bucket
adds) writes there and nothing ever reads it. Every write is a `scatter_` driven by tensors, so
a forward over the cache has fixed shapes and can be captured in a CUDA graph or compiled.
"""

import torch


class SlotKVCache:
    is_compileable = True

    def __init__(self, *, layers: int, slots: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (slots, kv_heads, max_len + 1, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.max_len = max_len
        self._rows = slice(0, 0)
        self._write_pos: torch.Tensor | None = None  # [B, T] cache column each new token goes to
        self._kv_len = 0

    @property
    def scratch_column(self) -> int:
        return self.max_len

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def bind(self, rows: slice, write_pos: torch.Tensor, kv_len: int) -> None:
        """Set the rows the next forward runs on, where it writes ([B, T] columns), and how many
        columns it reads."""
        self._rows, self._write_pos, self._kv_len = rows, write_pos, kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this forward's keys/values ([B, heads, T, dim]) and return the columns to attend."""
        index = self._write_pos[:, None, :, None].expand_as(key_states)
        keys, values = self.keys[layer_idx][self._rows], self.values[layer_idx][self._rows]
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys[:, :, : self._kv_len], values[:, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` columns of row `src` into row `dst` (packing rows)."""
        for tensor in self.keys + self.values:
            tensor[dst, :, :length] = tensor[src, :, :length]
