"""The model's forward over the paged cache, as small pure functions (gpt-fast's manner).

`decode_step` is the fixed-shape step: one token for each of B rows, B and `kv_len` fixed by the
caller's buckets (`verify_step`, W tokens a row: a speculating row's last token and its drafts), every input a tensor, the attention masks built on the device from the rows'
positions (one per layer kind the model has). It has no host sync and no data-dependent Python,
so it runs eagerly, compiles with `torch.compile(fullgraph=True)` and is captured in a CUDA graph
(node_agent/model/decoders.py) unchanged. Prefill uses `forward` with chunks of any width, of token ids
or (a prompt with images) embeddings.

A row's cache column is its `position` (the masks, the cache writes); its rotary position is the
column plus the row's `rope_offset`, which is 0 except after an image in a model with multimodal
rope (Qwen2.5-VL, Qwen3.5), where it is the prompt's `rope_delta` (node_agent/model/vision.py).
"""

import torch

from node_agent.model import cpu_attention
from node_agent.model.kv_cache import PackedChunk, PagedCache


def attention_masks(
    model: torch.nn.Module,
    cache: PagedCache,
    positions: torch.Tensor,
    kv_len: int,
    sees_until: torch.Tensor | None = None,
) -> torch.Tensor | dict[str, torch.Tensor | None] | None:
    """Each layer type's mask ([B, 1, T, columns]; None for linear attention), as the model takes
    them: one mask when all its layers are of one type, else a mapping by the config's layer type.
    Boolean for SDPA; additive (0 or the dtype's minimum) for eager attention, which adds it."""
    masks = cache.attention_masks(positions, kv_len, sees_until)
    if model.config._attn_implementation == "eager":
        minimum = torch.finfo(model.dtype).min
        masks = {
            name: None
            if mask is None
            else torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill(
                ~mask, minimum
            )
            for name, mask in masks.items()
        }
    return next(iter(masks.values())) if len(masks) == 1 else masks


def reads_in_place(model: torch.nn.Module) -> bool:
    """Whether the model's decode attention reads the paged cache in place (a CPU model whose
    kernel is built, node_agent/model/cpu_attention.py; compiled too, the kernel as an opaque operator)."""
    return model.config.get_text_config()._attn_implementation == cpu_attention.NAME


def forward(
    model: torch.nn.Module,
    cache: PagedCache,
    rows: slice,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    write_pos: torch.Tensor,
    kv_len: int,
    *,
    inputs_embeds: torch.Tensor | None = None,
    rope_positions: torch.Tensor | None = None,
    sees_until: torch.Tensor | None = None,
    decode: bool = False,
) -> torch.Tensor:
    """Run cache rows `rows` over `input_ids` [B, T] (or `inputs_embeds` [B, T, H]) at `positions`,
    writing the cache at `write_pos`; returns the last hidden states [B, T, H]. `rope_positions`
    ([B, T], or [3, B, T] for multimodal rope): the rotary positions, where they differ;
    `sees_until` ([B, T]): the last position each token sees, where image tokens see their whole
    image (Gemma 3). `decode`: one token a row, each seeing every position up to its own."""
    cache.bind(rows, write_pos, kv_len, in_place=decode and reads_in_place(model))
    out = model.get_decoder()(
        input_ids=None if inputs_embeds is not None else input_ids,
        inputs_embeds=inputs_embeds,
        position_ids=positions if rope_positions is None else rope_positions,
        attention_mask=attention_masks(model, cache, positions, kv_len, sees_until),
        past_key_values=cache,
        use_cache=True,
        paged_cache=cache,
    )
    return out.last_hidden_state


def packed_forward(
    model: torch.nn.Module,
    cache: PagedCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    decode_rows: torch.Tensor,
    chunks: list[PackedChunk],
) -> torch.Tensor:
    """One forward over the tokens of several sequences in one row, as vLLM's flattened batch: first
    one decode token of each of the rows `decode_rows` ([D], possibly none; a speculating row's last
    token and draft tokens each), then each prefill chunk's tokens; every Linear
    layer reads its weights once for all of them. `tokens` and `positions` are [T]; returns the
    hidden states [T, H]. Only for a model whose attention reads the cache in place (the attention
    finds each token's sequence in the cache's binding: the mask passed through is a placeholder)."""
    cache.bind_packed(positions, decode_rows, chunks)
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=tokens.device)
    types = set(cache.layer_types)
    out = model.get_decoder()(
        input_ids=tokens[None],
        position_ids=positions[None],
        attention_mask=placeholder if len(types) == 1 else dict.fromkeys(types, placeholder),
        past_key_values=cache,
        use_cache=True,
        paged_cache=cache,
    )
    return out.last_hidden_state[0]


def logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits for hidden states [..., H], scaled and soft-capped as the model's own head does."""
    out = model.get_output_embeddings()(hidden).float()
    config = model.config
    if getattr(config, "logits_scaling", None):  # granite
        out = out / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):  # gemma2, gemma3
        out = torch.tanh(out / config.final_logit_softcapping) * config.final_logit_softcapping
    return out


def decode_step(
    model: torch.nn.Module,
    cache: PagedCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    rope_offsets: torch.Tensor,
    kv_len: int,
) -> torch.Tensor:
    """One token for each of rows 0..B-1: `tokens`, `positions` and `rope_offsets` are [B]; each row
    writes at `positions[b]` (the scratch position for padding rows) and is rotated to
    `positions[b] + rope_offsets[b]`. Returns logits [B, V]."""
    positions = positions[:, None]
    hidden = forward(
        model,
        cache,
        slice(0, tokens.shape[0]),
        tokens[:, None],
        positions,
        positions,
        kv_len,
        rope_positions=positions + rope_offsets[:, None],
        decode=True,
    )
    return logits(model, hidden[:, -1])


def padded_inputs(
    rows: list[tuple[list[int], int]], out: torch.Tensor, scratch: int, max_len: int
) -> None:
    """Fill `out` [3, B, W] (token ids, positions, write positions) with rows of (tokens, first
    position), each right-padded to W: a row's positions run on from its start (clamped to the
    cache), its padding writes the scratch position; rows past `rows` are padding rows (token 0,
    every column at the scratch position). The layout `forward` over several rows and `verify_step` take."""
    out[0].zero_()
    out[1:].fill_(scratch)
    width = out.shape[2]
    for i, (tokens, start) in enumerate(rows):
        n = len(tokens)
        out[0, i, :n] = torch.tensor(tokens)
        out[1, i] = torch.arange(start, start + width).clamp(max=max_len - 1)
        out[2, i, :n] = out[1, i, :n]


def verify_step(
    model: torch.nn.Module,
    cache: PagedCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    write_pos: torch.Tensor,
    rope_offsets: torch.Tensor,
    kv_len: int,
) -> torch.Tensor:
    """W tokens for each of rows 0..B-1 (a row's last token, then its draft tokens): `tokens`,
    `positions` and `write_pos` are [B, W] (a row with fewer drafts, and a padding row, write their
    padding at the scratch position), `rope_offsets` [B]; each token sees the positions up to its
    own. Returns logits [B, W, V]."""
    hidden = forward(
        model,
        cache,
        slice(0, tokens.shape[0]),
        tokens,
        positions,
        write_pos,
        kv_len,
        rope_positions=positions + rope_offsets[:, None],
    )
    return logits(model, hidden)
