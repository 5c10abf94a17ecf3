"""The paged cache: every attention layer's keys and values in one pool of fixed-size blocks, read
and written through per-row block tables; linear-attention layers keep one state per row. Plugged
into transformers models as their cache.

A sequence holds a list of blocks (node_agent/engine/blocks.py hands them out); its row's block
table (`block_tables[row]`, padded with the null block 0) maps position p to the cache slot
`table[p // block_size] * block_size + p % block_size`. A forward over rows [a, b) writes each
new token's keys at its slot and attends over the slots of positions 0..kv_len-1 gathered through
the tables (vLLM's paged attention, as a copy of the row's blocks plus SDPA). Padding (of a prefill chunk, or the
rows a decode bucket adds) has the scratch position `max_len`: it writes into the null block,
which nothing reads unmasked, and keeps its row's linear-attention state. Every read and write is
driven by tensors of fixed shape (the tables are [slots, max_blocks]), so a decode step compiles
with fullgraph=True and is captured in a CUDA graph unchanged.

Layer kinds (`layer_kinds`):
- full attention: `PagedAttention`, each query sees every position up to its own;
- sliding window: `PagedAttention` with a window: each query sees the last `window` positions
  (its blocks stay held for the whole sequence, so prefixes stay reusable);
- linear attention (Qwen3-Next / Qwen3.5 GatedDeltaNet): `LinearAttentionState`, a conv state
  and a recurrent state per row; a row whose forward starts at position 0 starts from zeros (so
  a reused row never reads its previous sequence's state). Rows are packed (`move_row`).
"""

import ctypes
import sys
from dataclasses import dataclass

import torch

from shared.model_files import ModelLoadError

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


def layer_types(config) -> list[str]:
    """The config's name for each layer's kind (models without `layer_types` have one kind)."""
    declared = getattr(config, "layer_types", None)
    if declared:
        return list(declared)
    sliding = getattr(config, "sliding_window", None) and getattr(
        config, "use_sliding_window", True
    )
    return [SLIDING if sliding else FULL] * config.num_hidden_layers


def layer_kinds(config, max_len: int) -> list[str]:
    """The cache kind of each layer. A window that covers the whole context is full attention."""
    window = getattr(config, "sliding_window", None)
    kinds = [
        FULL if kind == SLIDING and (not window or window >= max_len) else kind
        for kind in layer_types(config)
    ]
    unknown = sorted(set(kinds) - {FULL, SLIDING, LINEAR})
    if unknown:
        raise ModelLoadError(
            f"layer kinds {unknown} have no cache kind here (known: {FULL}, {SLIDING}, {LINEAR})"
        )
    return kinds


def attention_shape(config, ranks: int = 1) -> tuple[int, int]:
    """(key/value heads on one rank, head dim) of the model's attention layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return kv_heads // ranks, head_dim


def bytes_per_token(config, max_len: int, dtype_bytes: int, ranks: int = 1) -> int:
    """What one token's keys and values take over all attention layers (on one rank)."""
    kv_heads, head_dim = attention_shape(config, ranks)
    attention = sum(kind != LINEAR for kind in layer_kinds(config, max_len))
    return 2 * attention * kv_heads * head_dim * dtype_bytes


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def _pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool; on a Linux CPU backed by transparent huge pages where the kernel allows them
    (`madvise` mode), before its pages are touched: blocks are read in random order, and with 4 KB
    pages nearly every block read also missed the TLB."""
    pool = torch.empty(shape, dtype=dtype, device=device)
    size = pool.numel() * pool.element_size()
    if device.type == "cpu" and size >= 2 * _HUGE_PAGE and sys.platform == "linux":
        start = -(-pool.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        length = (pool.data_ptr() + size - start) // _HUGE_PAGE * _HUGE_PAGE
        ctypes.CDLL(None, use_errno=True).madvise(
            ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE
        )
    return pool.zero_()


class PagedAttention:
    """Keys and values of one attention layer: [heads, (blocks + 1) * block_size, dim] each, the
    first block the null block. Heads outermost, so that a row's gathered blocks are one contiguous
    [positions, dim] run per head: SDPA reads them at full speed. `window`: a sliding window's
    length (None: full attention)."""

    def __init__(
        self,
        *,
        blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        window: int | None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (kv_heads, (blocks + 1) * block_size, head_dim)
        self.keys, self.values = (_pool(shape, dtype, torch.device(device)) for _ in range(2))
        self.block_size, self.window = block_size, window

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    def write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, write_slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys/values ([B, heads, T, dim]) at `write_slots` ([B * T]); returns
        the pools."""
        for pool, states in ((self.keys, key_states), (self.values, value_states)):
            pool.index_copy_(
                1,
                write_slots,
                states.transpose(0, 1).reshape(pool.shape[0], -1, pool.shape[2]).to(pool.dtype),
            )
        return self.keys, self.values

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        write_slots: torch.Tensor,
        read_blocks: torch.Tensor,
        buffers: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys/values ([B, heads, T, dim]) at `write_slots` ([B * T]) and
        return the blocks `read_blocks` ([B, blocks]) names (`read`)."""
        self.write(key_states, value_states, write_slots)
        return self.read(read_blocks, buffers)

    def read(
        self, read_blocks: torch.Tensor, buffers: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the blocks `read_blocks` ([B, blocks]) names, as [B, heads,
        blocks * block_size, dim]. The read copies whole blocks (one index_select of
        block_size * dim runs per head; an element-wise gather of the slots cost 6-10x more on a
        CPU), into `buffers` (two flat tensors of at least that size) when given."""
        heads, _, dim = self.keys.shape
        rows, blocks = read_blocks.shape
        flat = read_blocks.reshape(-1)
        out = []
        for i, pool in enumerate(self.tensors):
            runs = pool.view(heads, -1, self.block_size * dim)
            if buffers is None:
                read = runs.index_select(1, flat)
            else:
                read = buffers[i][: heads * flat.numel() * runs.shape[-1]].view(
                    heads, flat.numel(), -1
                )
                torch.index_select(runs, 1, flat, out=read)
            out.append(read.view(heads, rows, blocks * self.block_size, dim).transpose(0, 1))
        return out[0], out[1]

    def attention_mask(
        self, positions: torch.Tensor, width: int, sees_until: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, 1, T, width] bool: the query at position p sees position q <= p (within the window);
        with `sees_until` ([B, T], a prefill chunk's image tokens that attend both ways within
        their image), also the positions p < q <= sees_until."""
        columns = torch.arange(width, device=positions.device)[None, None, :]
        ahead = columns - positions[:, :, None]
        mask = ahead <= 0
        if self.window is not None:
            mask &= ahead > -self.window
        if sees_until is not None:
            mask |= (ahead > 0) & (columns <= sees_until[:, :, None])
        return mask[:, None]

    def move_row(self, src: int, dst: int) -> None:
        """Rows own no keys here: their block tables move (`PagedCache.move_row`)."""


class LinearAttentionState:
    """One GatedDeltaNet layer's state per row: the last `kernel` inputs of its causal conv
    ([slots, conv_dim, kernel], the model's dtype) and its recurrent state ([slots, heads, k_dim,
    v_dim], float32 as the model computes it). Writes are `torch.where`s keyed on the positions:
    padding rows keep their state, rows starting at position 0 start from zeros."""

    def __init__(
        self,
        *,
        slots: int,
        conv_dim: int,
        kernel: int,
        heads: int,
        k_dim: int,
        v_dim: int,
        scratch_position: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
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

    def attention_mask(
        self, positions: torch.Tensor, width: int, sees_until: torch.Tensor | None = None
    ) -> None:
        """Linear attention takes no mask: no padding token ever reaches it (see the scheduler)."""
        return None

    def conv_inputs(
        self, rows: slice, write_pos: torch.Tensor, new_inputs: torch.Tensor
    ) -> torch.Tensor:
        """The conv's inputs [B, conv_dim, kernel + T]: the stored last inputs, then this forward's
        ([B, conv_dim, T]); keeps the last `kernel` of them."""
        inputs = torch.cat([self._start(self.conv[rows], write_pos), new_inputs], dim=-1)
        self._commit(self.conv[rows], inputs[..., -self.kernel :], write_pos)
        return inputs

    def recurrent_state(self, rows: slice, write_pos: torch.Tensor) -> torch.Tensor:
        return self._start(self.recurrent[rows], write_pos)

    def update_recurrent(self, rows: slice, write_pos: torch.Tensor, state: torch.Tensor) -> None:
        self._commit(self.recurrent[rows], state, write_pos)

    def move_row(self, src: int, dst: int) -> None:
        for tensor in self.tensors:
            tensor[dst] = tensor[src]


def _linear(
    config, *, slots: int, scratch_position: int, dtype: torch.dtype, device: torch.device
) -> LinearAttentionState:
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim = 2 * k_dim * config.linear_num_key_heads + v_dim * config.linear_num_value_heads
    return LinearAttentionState(
        slots=slots,
        conv_dim=conv_dim,
        kernel=config.linear_conv_kernel_dim,
        heads=config.linear_num_value_heads,
        k_dim=k_dim,
        v_dim=v_dim,
        scratch_position=scratch_position,
        dtype=dtype,
        device=device,
    )


@dataclass
class PackedChunk:
    """A prefill chunk in a packed forward: `length` tokens of row `row` from position `start`, at
    `offset` in the forward's tokens."""

    row: int
    start: int
    length: int
    offset: int


class PagedCache:
    """Every layer's cache, with the transformers Cache interface the models call: `update` for
    attention layers, the conv/recurrent state methods for linear-attention ones; and the rows'
    block tables ([slots, max_blocks], set by the runner)."""

    is_compileable = True

    def __init__(
        self,
        layers: list[PagedAttention | LinearAttentionState],
        layer_types: list[str],
        *,
        slots: int,
        max_len: int,
        blocks: int,
        block_size: int,
        device: torch.device,
    ):
        self.layers, self.layer_types, self.max_len, self.device = (
            layers,
            layer_types,
            max_len,
            device,
        )
        self.blocks, self.block_size = blocks, block_size
        self.max_blocks = -(-max_len // block_size)
        self.block_tables = torch.zeros(slots, self.max_blocks, dtype=torch.long, device=device)
        self._row_span = (
            0,
            0,
        )  # the bound rows' first and end (a slice of symbolic bounds would be specialized
        # when torch.compile writes this attribute back after a compiled step)
        self._write_pos: torch.Tensor | None = None  # [B, T] position each new token is written at
        self._write_slots: torch.Tensor | None = None  # [B * T] the cache slot each is written at
        self._read_blocks: torch.Tensor | None = (
            None  # [B, W / block_size] the blocks of positions 0..W-1
        )
        self._kv_len = 0
        # CPU: where attention layers copy the blocks they read (the pools' dtype), or a kernel packs them (float32)
        self._read_buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        self._read_tables: torch.Tensor | None = None  # [B, max_blocks], and
        self._read_lengths: torch.Tensor | None = (
            None  # [B]: what an in-place read's decode rows see
        )
        self._chunk_masks: list[
            dict[str, torch.Tensor | None]
        ] = []  # a packed forward's chunks' masks
        self.reads_in_place = False  # the bound forward's attention reads the pools itself
        self.packed: list[PackedChunk] | None = None  # a packed forward's chunks (bind_packed)

    @classmethod
    def for_model(
        cls,
        config,
        *,
        slots: int,
        max_len: int,
        blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        ranks: int = 1,
    ) -> "PagedCache":
        """The cache of `config`'s layers with `blocks` blocks; under tensor parallelism over
        `ranks` ranks, each rank's share of the KV heads (tensor parallelism is refused for the
        other kinds)."""
        window = getattr(config, "sliding_window", None)
        kv_heads, head_dim = attention_shape(config, ranks)
        paged = dict(
            blocks=blocks,
            block_size=block_size,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )
        layers = [
            _linear(config, slots=slots, scratch_position=max_len, dtype=dtype, device=device)
            if kind == LINEAR
            else PagedAttention(window=window if kind == SLIDING else None, **paged)
            for kind in layer_kinds(config, max_len)
        ]
        return cls(
            layers,
            layer_types(config),
            slots=slots,
            max_len=max_len,
            blocks=blocks,
            block_size=block_size,
            device=torch.device(device),
        )

    @property
    def scratch_position(self) -> int:
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
        return [
            t
            for layer in self.layers
            if isinstance(layer, LinearAttentionState)
            for t in layer.tensors
        ]

    def width(self, kv_len: int) -> int:
        """Positions a forward reading positions < kv_len attends over: whole blocks."""
        return min(-(-kv_len // self.block_size), self.max_blocks) * self.block_size

    def bind(
        self, rows: slice, write_pos: torch.Tensor, kv_len: int, in_place: bool = False
    ) -> None:
        """Set the rows the next forward runs on, where it writes ([B, T] positions; the scratch
        position for padding), and how many positions it reads. `in_place` (a decode forward
        whose attention reads the pools itself, node_agent/model/cpu_attention.py): attention
        layers hand back their pools, and the rows' tables and lengths are `read_rows()`."""
        tables = self.block_tables[rows]
        size = self.block_size
        index = (write_pos // size).clamp(max=self.max_blocks - 1)
        slots = tables.gather(1, index) * size + write_pos % size
        self._write_slots = torch.where(write_pos >= self.max_len, 0, slots).reshape(-1)
        self._read_blocks = tables[:, : self.width(kv_len) // size]
        self._row_span, self._write_pos, self._kv_len = (rows.start, rows.stop), write_pos, kv_len
        last = write_pos[
            :, -1
        ]  # what an in-place read takes: a padding row (at the scratch position) reads one
        self._read_tables, self._read_lengths = (
            tables,
            torch.where(last >= self.max_len, 0, last) + 1,
        )  # position
        self.reads_in_place, self.packed, self._chunk_masks = in_place, None, []

    def bind_packed(
        self, positions: torch.Tensor, decode_rows: torch.Tensor, chunks: list[PackedChunk]
    ) -> None:
        """Bind a packed forward (one row of tokens from several sequences, at `positions` [T]):
        first one decode token for each of `decode_rows` ([D]; a row may come several times, a
        speculating row's tokens, each seeing the positions up to its own), then each chunk's
        tokens. Its attention reads in place (node_agent/model/cpu_attention.py): the decode tokens
        through `read_rows()`, each chunk through `read_chunk`. (Linear-attention layers never pack.)"""
        device, size, decoding = self.block_tables.device, self.block_size, decode_rows.shape[0]
        rows = torch.cat(
            [decode_rows] + [torch.full((c.length,), c.row, device=device) for c in chunks]
        )
        self._write_slots = self.block_tables[rows, positions // size] * size + positions % size
        self._row_span, self._write_pos = (0, 0), positions[:decoding, None]
        self._read_tables, self._read_lengths = (
            self.block_tables[decode_rows],
            positions[:decoding] + 1,
        )
        self._kv_len = int(positions.max()) + 1
        self._chunk_masks = [
            self.attention_masks(
                positions[None, c.offset : c.offset + c.length], c.start + c.length
            )
            for c in chunks
        ]  # each layer type's, once a forward
        self.reads_in_place, self.packed = True, chunks

    def read_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """An in-place read's block tables ([B, max_blocks]) and the positions each of its decode
        rows sees ([B]: its own and all before)."""
        return self._read_tables, self._read_lengths

    def read_chunk(
        self, layer_idx: int, index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed forward's chunk `index`: its keys and values ([1, heads, width, dim], its
        row's blocks up to its last position) and its attention mask ([1, 1, length, width])."""
        chunk, layer = self.packed[index], self.layers[layer_idx]
        width = self.width(chunk.start + chunk.length)
        keys, values = layer.read(
            self.block_tables[chunk.row : chunk.row + 1, : width // self.block_size],
            self._buffers(layer, width),
        )
        return keys, values, self._chunk_masks[index][self.layer_types[layer_idx]]

    def chunk_in_place(
        self, layer_idx: int, chunk: PackedChunk, tile: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """What a kernel reading the packed forward's `chunk` in place takes: its row's block table
        ([max_blocks]) and two float32 buffers for the keys and values it packs, of at least the
        chunk's positions rounded up to `tile`."""
        positions = -(-(chunk.start + chunk.length) // tile) * tile
        return self.block_tables[chunk.row], self._buffers(
            self.layers[layer_idx], positions, torch.float32
        )

    def attention_masks(
        self, positions: torch.Tensor, kv_len: int, sees_until: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor | None]:
        """Each layer type's mask ([B, 1, T, width] bool; None for linear attention)."""
        masks: dict[str, torch.Tensor | None] = {}
        for layer_type, layer in zip(self.layer_types, self.layers):
            if layer_type not in masks:
                masks[layer_type] = layer.attention_mask(positions, self.width(kv_len), sees_until)
        return masks

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ):
        layer = self.layers[layer_idx]
        if self.reads_in_place:
            return layer.write(key_states, value_states, self._write_slots)
        buffers = self._buffers(layer, self._read_blocks.numel() * self.block_size)
        return layer.update(key_states, value_states, self._write_slots, self._read_blocks, buffers)

    def _buffers(
        self, layer: PagedAttention, positions: int, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor] | None:
        """On a CPU, two buffers every layer reuses for the blocks it reads (a fresh allocation of
        tens of MB page-faults its way in at every layer of every step: 5x the copy itself), in
        `dtype` (default the pools'); grown to the largest read yet. None on a GPU (its caching
        allocator reuses memory, and a captured graph must own what it reads) and while compiling."""
        if self.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        heads, _, dim = layer.keys.shape
        needed, dtype = heads * positions * dim, dtype or layer.keys.dtype
        buffers = self._read_buffers.get(dtype)
        if not buffers or buffers[0].numel() < needed:
            buffers = self._read_buffers[dtype] = [
                torch.empty(needed, dtype=dtype, device=self.device) for _ in range(2)
            ]
        return buffers

    @property
    def _rows(self) -> slice:
        return slice(*self._row_span)

    def is_recording_past(self, layer_idx: int) -> bool:
        """True: the model then hands every conv input to `update_conv_state` (it never updates a
        conv state it was given in place), so padding rows can keep theirs."""
        return True

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.layers[layer_idx].conv[
            self._rows
        ]  # only tested for None: the inputs come from update_conv_state

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        return self.layers[layer_idx].conv_inputs(self._rows, self._write_pos, conv_states)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.layers[layer_idx].recurrent_state(self._rows, self._write_pos)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ):
        self.layers[layer_idx].update_recurrent(self._rows, self._write_pos, recurrent_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def set_tables(self, tables: torch.Tensor) -> None:
        """Rows 0..n-1's block tables ([n, max_blocks], host memory), copied in one go."""
        self.block_tables[: tables.shape[0]].copy_(tables, non_blocking=True)

    def move_row(self, src: int, dst: int) -> None:
        """Move row `src`'s per-row state to row `dst` (packing rows); its block table moves with
        the next `set_tables`."""
        for layer in self.layers:
            layer.move_row(src, dst)
