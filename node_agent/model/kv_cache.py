"""The slot cache: one row per slot in every layer, each layer of the kind the model's config
names, plugged into transformers models as their cache.

Active sequences occupy rows 0..n-1 (the engine keeps them packed), so a forward over rows
[a, b) reads views of the cache, never gathers. Each row writes at its own positions, given as a
tensor (`bind`), which HF's StaticCache (one position vector for the whole batch) cannot do.
Position `max_len` is the scratch position: padding (of a prefill chunk, or the rows a decode
bucket adds) writes there, nothing ever reads it, and a row whose first token is padding keeps
its linear-attention state. Every write is driven by tensors, so a forward over the cache has
fixed shapes and can be captured in a CUDA graph or compiled.

Layer kinds (`layer_kinds`):
- full attention: `AttentionKV` with `max_len` columns (position p at column p);
- sliding window: `AttentionKV` as a ring of `window + prefill_chunk_tokens` columns (position p
  at column p mod ring), so one prefill chunk never overwrites keys its own queries still need;
- linear attention (Qwen3-Next / Qwen3.5 GatedDeltaNet): `LinearAttentionState`, a conv state
  and a recurrent state per row; a row whose forward starts at position 0 starts from zeros (so
  a reused row never reads its previous sequence's state).
"""

import torch

from shared.model_files import ModelLoadError

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


def layer_types(config) -> list[str]:
    """The config's name for each layer's kind (models without `layer_types` have one kind)."""
    declared = getattr(config, "layer_types", None)
    if declared:
        return list(declared)
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return [SLIDING if sliding else FULL] * config.num_hidden_layers


def layer_kinds(config, max_len: int) -> list[str]:
    """The cache kind of each layer. A window that covers the whole context is full attention."""
    window = getattr(config, "sliding_window", None)
    kinds = [FULL if kind == SLIDING and (not window or window >= max_len) else kind for kind in layer_types(config)]
    unknown = sorted(set(kinds) - {FULL, SLIDING, LINEAR})
    if unknown:
        raise ModelLoadError(f"layer kinds {unknown} have no cache kind here (known: {FULL}, {SLIDING}, {LINEAR})")
    return kinds


class AttentionKV:
    """Keys and values of one attention layer: `columns` cache columns per row used as a ring
    (position p at column p mod columns), plus a scratch column. Full attention is the ring that
    never wraps (`columns = max_len`, `window = None`); a sliding window of w keeps w + one prefill
    chunk's columns."""

    def __init__(self, *, slots: int, kv_heads: int, head_dim: int, columns: int, window: int | None,
                 scratch_position: int, dtype: torch.dtype, device: torch.device):
        shape = (slots, kv_heads, columns + 1, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.columns, self.window, self.scratch_position = columns, window or columns, scratch_position

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    def width(self, kv_len: int) -> int:
        """Columns a forward attending over positions < kv_len reads."""
        return min(kv_len, self.columns)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, rows: slice, write_pos: torch.Tensor,
               kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys/values ([B, heads, T, dim]) and return the columns to attend."""
        column = torch.where(write_pos == self.scratch_position, self.columns, write_pos % self.columns)
        index = column[:, None, :, None].expand_as(key_states)
        keys, values = self.keys[rows], self.values[rows]
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        width = self.width(kv_len)
        return keys[:, :, :width], values[:, :, :width]

    def attention_mask(self, positions: torch.Tensor, kv_len: int, sees_until: torch.Tensor | None = None) -> torch.Tensor:
        """[B, 1, T, width] bool: the query at position p sees the column holding position
        q = p - ((p - column) mod columns) when 0 <= q and p - q < window; with `sees_until` ([B, T],
        a prefill chunk's image tokens that attend bidirectionally within their image), also the
        positions p < q <= sees_until this forward writes."""
        columns = torch.arange(self.width(kv_len), device=positions.device)
        age = (positions[:, :, None] - columns[None, None, :]) % self.columns
        mask = (age <= positions[:, :, None]) & (age < self.window)
        if sees_until is not None:
            ahead = (columns[None, None, :] - positions[:, :, None]) % self.columns
            mask |= (ahead > 0) & (ahead <= (sees_until - positions)[:, :, None])
        return mask[:, None]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy what row `src` holds of its first `length` positions into row `dst`."""
        width = self.width(length)
        for tensor in self.tensors:
            tensor[dst, :, :width] = tensor[src, :, :width]


class LinearAttentionState:
    """One GatedDeltaNet layer's state per row: the last `kernel` inputs of its causal conv
    ([slots, conv_dim, kernel], the model's dtype) and its recurrent state ([slots, heads, k_dim,
    v_dim], float32 as the model computes it). Writes are `torch.where`s keyed on the positions:
    padding rows keep their state, rows starting at position 0 start from zeros."""

    def __init__(self, *, slots: int, conv_dim: int, kernel: int, heads: int, k_dim: int, v_dim: int,
                 scratch_position: int, dtype: torch.dtype, device: torch.device):
        self.conv = torch.zeros(slots, conv_dim, kernel, dtype=dtype, device=device)
        self.recurrent = torch.zeros(slots, heads, k_dim, v_dim, dtype=torch.float32, device=device)
        self.kernel, self.scratch_position = kernel, scratch_position

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.conv, self.recurrent]

    @staticmethod
    def _per_row(flags: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return flags.view(-1, *[1] * (state.dim() - 1))

    def _start(self, state: torch.Tensor, write_pos: torch.Tensor) -> torch.Tensor:
        """The state a forward starts from: zeros for rows whose sequence starts here."""
        return state.masked_fill(self._per_row(write_pos[:, 0] == 0, state), 0)

    def _commit(self, state: torch.Tensor, new: torch.Tensor, write_pos: torch.Tensor) -> None:
        padding = self._per_row(write_pos[:, 0] == self.scratch_position, state)
        state.copy_(torch.where(padding, state, new.to(state.dtype)))

    def attention_mask(self, positions: torch.Tensor, kv_len: int, sees_until: torch.Tensor | None = None) -> None:
        """Linear attention takes no mask: no padding token ever reaches it (see the engine's prefill)."""
        return None

    def conv_inputs(self, rows: slice, write_pos: torch.Tensor, new_inputs: torch.Tensor) -> torch.Tensor:
        """The conv's inputs [B, conv_dim, kernel + T]: the stored last inputs, then this forward's
        ([B, conv_dim, T]); keeps the last `kernel` of them."""
        inputs = torch.cat([self._start(self.conv[rows], write_pos), new_inputs], dim=-1)
        self._commit(self.conv[rows], inputs[..., -self.kernel:], write_pos)
        return inputs

    def recurrent_state(self, rows: slice, write_pos: torch.Tensor) -> torch.Tensor:
        return self._start(self.recurrent[rows], write_pos)

    def update_recurrent(self, rows: slice, write_pos: torch.Tensor, state: torch.Tensor) -> None:
        self._commit(self.recurrent[rows], state, write_pos)

    def move_row(self, src: int, dst: int, length: int) -> None:
        for tensor in self.tensors:
            tensor[dst] = tensor[src]


def _attention(config, *, slots: int, columns: int, window: int | None, scratch_position: int,
               dtype: torch.dtype, device: torch.device, ranks: int) -> AttentionKV:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return AttentionKV(slots=slots, kv_heads=kv_heads // ranks, head_dim=head_dim, columns=columns, window=window,
                       scratch_position=scratch_position, dtype=dtype, device=device)


def _linear(config, *, slots: int, scratch_position: int, dtype: torch.dtype, device: torch.device) -> LinearAttentionState:
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim = 2 * k_dim * config.linear_num_key_heads + v_dim * config.linear_num_value_heads
    return LinearAttentionState(slots=slots, conv_dim=conv_dim, kernel=config.linear_conv_kernel_dim,
                                heads=config.linear_num_value_heads, k_dim=k_dim, v_dim=v_dim,
                                scratch_position=scratch_position, dtype=dtype, device=device)


class SlotCache:
    """Every layer's cache, with the transformers Cache interface the models call: `update` for
    attention layers, the conv/recurrent state methods for linear-attention ones."""

    is_compileable = True

    def __init__(self, layers: list[AttentionKV | LinearAttentionState], layer_types: list[str], max_len: int,
                 device: torch.device):
        self.layers, self.layer_types, self.max_len, self.device = layers, layer_types, max_len, device
        self._rows = slice(0, 0)
        self._write_pos: torch.Tensor | None = None  # [B, T] position each new token is written at
        self._kv_len = 0

    @classmethod
    def for_model(cls, config, *, slots: int, max_len: int, prefill_chunk_tokens: int, dtype: torch.dtype,
                  device: torch.device, ranks: int = 1) -> "SlotCache":
        """The cache of `config`'s layers; under tensor parallelism over `ranks` ranks, each rank's
        share of the KV heads (tensor parallelism is refused for the other kinds)."""
        window = getattr(config, "sliding_window", None)
        common = dict(slots=slots, scratch_position=max_len, dtype=dtype, device=device)
        attention = dict(common, ranks=ranks)
        layers = [
            _linear(config, **common) if kind == LINEAR
            else _attention(config, columns=min(window + prefill_chunk_tokens, max_len), window=window, **attention)
            if kind == SLIDING else _attention(config, columns=max_len, window=None, **attention)
            for kind in layer_kinds(config, max_len)
        ]
        return cls(layers, layer_types(config), max_len, torch.device(device))

    @property
    def scratch_column(self) -> int:
        """The position padding writes at."""
        return self.max_len

    @property
    def has_linear_attention(self) -> bool:
        """Whether some layer folds every token it reads into a state (so padding must never reach it)."""
        return any(isinstance(layer, LinearAttentionState) for layer in self.layers)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors)

    def linear_states(self) -> list[torch.Tensor]:
        """The tensors a step moves on (so running a step twice is not running it once): what a
        warm-up before capturing a step must put back."""
        return [t for layer in self.layers if isinstance(layer, LinearAttentionState) for t in layer.tensors]

    def bind(self, rows: slice, write_pos: torch.Tensor, kv_len: int) -> None:
        """Set the rows the next forward runs on, where it writes ([B, T] positions), and how many
        positions it reads."""
        self._rows, self._write_pos, self._kv_len = rows, write_pos, kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, self._rows, self._write_pos, self._kv_len)

    def is_recording_past(self, layer_idx: int) -> bool:
        """True: the model then hands every conv input to `update_conv_state` (it never updates a
        conv state it was given in place), so padding rows can keep theirs."""
        return True

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.layers[layer_idx].conv[self._rows]  # only tested for None: the inputs come from update_conv_state

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> torch.Tensor:
        return self.layers[layer_idx].conv_inputs(self._rows, self._write_pos, conv_states)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.layers[layer_idx].recurrent_state(self._rows, self._write_pos)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.layers[layer_idx].update_recurrent(self._rows, self._write_pos, recurrent_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Move row `src` (which holds `length` positions) to row `dst` (packing rows)."""
        for layer in self.layers:
            layer.move_row(src, dst, length)
