"""Attention on a CPU that reads the paged KV cache in place (csrc/paged_attention.cpp).

A decode step's attention otherwise copies every block each row reads into one tensor for SDPA
(node_agent/model/kv_cache.py): at 2k tokens of context that copy was 43-45% of the default
model's step, more than the attention itself. The decode kernel walks each row's block table and
reads keys and values where the pool holds them, one key load for all the query heads of its
group, with an online softmax in float32; sliding windows and soft-capping as the layer has them.

A prefill chunk of a packed forward (causal, no window, no soft-capping) goes through the prefill
kernel: flash attention over its row's blocks, packed once a call into float32 tiles, its two
products by oneDNN's batch-reduce GEMM (JIT-compiled for the machine's vector units): 2.1-2.8x
torch's CPU flash attention on 512-token chunks on a 2-vCPU Zen 5, in float32 and bfloat16
(docs/benchmarks.md). Other chunks (windows, soft-capping, sinks) copy their blocks and run SDPA
under their masks.

The kernels are built at the first load of a CPU model on this machine (node_agent/model/cpu_kernels.py);
where they cannot be, attention keeps the copy and a log line says why.

They plug into transformers as an attention implementation (`NAME`) for the architectures that
run SDPA: forwards whose cache reads in place go through the kernels, every other call (vision
towers, transformers' own forwards) is transformers' SDPA unchanged.
"""

import functools
import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from node_agent.model import cpu_kernels

log = logging.getLogger(__name__)

NAME = "cortex_cpu_paged"
MAX_HEAD_DIM = 256  # the kernel's kMaxDim
PREFILL_TILE = (
    128  # key positions a tile of the prefill kernel (64-512 measured: 64 and 128 fastest)
)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_cache=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface. `paged_cache` (node_agent/model/kv_cache.PagedCache, passed
    by node_agent/model/forward.py) reading in place: `key` and `value` are its pools; a decode
    forward's rows go through the kernel, and a packed forward's decode tokens too, its chunks
    through SDPA over their own rows' blocks. Otherwise SDPA over the keys and values given."""
    if paged_cache is None or not paged_cache.reads_in_place:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if paged_cache.packed is None:
        return _decode(module, query[:, :, 0], key, value, paged_cache, scale, kwargs)[
            :, None
        ], None
    decoding = paged_cache.read_rows()[1].shape[0]
    parts = (
        [
            _decode(
                module,
                query[0, :, :decoding].transpose(0, 1),
                key,
                value,
                paged_cache,
                scale,
                kwargs,
            )
        ]
        if decoding
        else []
    )
    causal = (
        not paged_cache.layers[module.layer_idx].window
        and not kwargs.get("softcap")
        and kwargs.get("s_aux") is None
    )
    for index, chunk in enumerate(paged_cache.packed):
        rows = query[:, :, chunk.offset : chunk.offset + chunk.length]
        if causal:
            parts.append(_prefill(rows, key, value, paged_cache, module.layer_idx, chunk, scale))
            continue
        keys, values, mask = paged_cache.read_chunk(module.layer_idx, index)
        parts.append(
            sdpa_attention_forward(
                module, rows, keys, values, mask, scaling=scale, dropout=dropout, **kwargs
            )[0][0]
        )
    return torch.cat(parts)[None], None


def _prefill(
    query: torch.Tensor,
    pool_keys: torch.Tensor,
    pool_values: torch.Tensor,
    paged_cache,
    layer_idx: int,
    chunk,
    scale: float,
) -> torch.Tensor:
    """A prefill chunk's queries ([1, heads, L, dim]) causally over its row's cache, read in place by
    the kernel (its two products in float32 by oneDNN's batch-reduce GEMM): [L, heads, dim]."""
    table, (keys_t, values) = paged_cache.chunk_in_place(layer_idx, chunk, PREFILL_TILE)
    return torch.ops.cortex.paged_prefill_attention(
        query[0],
        pool_keys,
        pool_values,
        table,
        chunk.start,
        paged_cache.block_size,
        scale,
        PREFILL_TILE,
        keys_t,
        values,
    )


def _decode(
    module: torch.nn.Module,
    query: torch.Tensor,
    pool_keys: torch.Tensor,
    pool_values: torch.Tensor,
    paged_cache,
    scale: float,
    kwargs: dict,
) -> torch.Tensor:
    """One query token a row ([rows, heads, dim]) over its row's cache, by the kernel."""
    tables, lengths = paged_cache.read_rows()
    window = paged_cache.layers[module.layer_idx].window or 0
    return torch.ops.cortex.paged_decode_attention(
        query,
        pool_keys,
        pool_values,
        tables,
        lengths,
        paged_cache.block_size,
        scale,
        window,
        float(kwargs.get("softcap") or 0.0),
    )


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(
    NAME, sdpa_mask
)  # a forward of transformers' own (no paged cache) gets SDPA's masks


def enable(model: torch.nn.Module) -> bool:
    """Run the model's text attention through `attention` (it must run SDPA now); False, with the
    reason logged, where the kernel is not there or the heads are wider than it takes."""
    config = model.config.get_text_config()
    if config._attn_implementation != "sdpa" or not cpu_kernels.load():
        return False
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim > MAX_HEAD_DIM:
        log.info(
            "CPU decode attention reads the KV cache through a copy: heads of %d dims (the kernel takes up to %d)",
            head_dim,
            MAX_HEAD_DIM,
        )
        return False
    config._attn_implementation = NAME
    _register_fakes()
    return True


@functools.cache
def _register_fakes() -> None:
    """The decode kernel's output shape, for a compiled step (node_agent/model/compiled_step.py)
    that calls it as an opaque operator: its query's."""
    torch.library.register_fake("cortex::paged_decode_attention")(
        lambda query, keys, values, tables, lengths, block_size, scale, window, softcap: (
            torch.empty_like(query)
        )
    )
