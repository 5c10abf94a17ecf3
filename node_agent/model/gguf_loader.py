"""Load a GGUF model with its Linear weights quantized as the file stores them, tensor by tensor:
the model is built with empty (meta) parameters, each tensor's bytes are read from the file
on their own and become a quantized layer (node_agent/model/gguf_weights.py) or a dense
parameter, so the host never holds the model at full precision (peak: the quantized weights,
one tensor's temporaries and the header; the pages a block's temporaries freed go back to the
system after it, node_agent/model/meta_model.return_freed_pages).

GGUF names map to transformers' with transformers' own map, and llama's permuted Q/K rows are
put back by its own tensor processor (which moves whole rows, so it works on blocks as well).

An output head tied to a Q8_0 embedding (most GGUF files of small models) is read as stored by a
float32 model on a CPU, a byte a weight (node_agent/model/int8_groups_cpu.py), as llama.cpp reads
it; the embedding's rows are still looked up from its dense copy."""

import functools
import os
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    LlamaTensorProcessor,
    TensorProcessor,
    get_gguf_hf_weights_map,
)

from node_agent.model import gguf_weights, int8_groups_cpu, meta_model
from node_agent.model.linear_shards import Plan
from shared import gguf_header
from shared.gguf_header import TensorInfo
from shared.weight_formats import EXACT_INT8_TYPES, gguf_layout

# Tensor processors that keep one GGUF tensor one transformers tensor (MoE ones split and merge experts).
_ROW_PROCESSORS = (TensorProcessor, LlamaTensorProcessor)


def stores_quantized(path: Path) -> bool:
    """Whether the file keeps any 2-D weight quantized, in an architecture this loader reads."""
    header = gguf_header.read(path)
    if TENSOR_PROCESSORS.get(header.architecture, TensorProcessor) not in _ROW_PROCESSORS:
        return False
    return any(gguf_layout(t.gguf_type) != "dense" and len(t.shape) == 2 for t in header.tensors)


def _read(fd: int, tensor: TensorInfo) -> np.ndarray:
    """A tensor's bytes, read on their own (no mapping of the file stays resident), in the shape
    and dtype the reader gives them (quantized: rows of blocks as uint8)."""
    raw = os.pread(fd, tensor.n_bytes, tensor.data_offset)
    return np.frombuffer(raw, dtype=tensor.data_dtype).reshape(tensor.data_shape)


@contextmanager
def _one_name_map():
    """transformers' `get_gguf_hf_weights_map` walks every submodule (about 400 in a small model)
    and builds gguf's name map, the same one, afresh at each: seconds of a load. While this is open,
    gguf's `get_tensor_name_map` (which it imports at each call) returns one map per architecture;
    the maps are only read."""
    plain = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(plain)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = plain


def _block(name: str) -> str | None:
    """The layer a GGUF tensor belongs to (`blk.N.…`), None for the others (embeddings, norms, head)."""
    return name.split(".", 2)[1] if name.startswith("blk.") else None


def _module_and_attr(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return model.get_submodule(owner), attr


def _place(
    model: torch.nn.Module,
    name: str,
    raw: np.ndarray,
    tensor: TensorInfo,
    dtype: torch.dtype,
    device: torch.device,
    plan: Plan,
) -> None:
    """Put this rank's part (`plan`) of one tensor where the model holds it: a quantized Linear
    weight replaces its layer (where the kernels take its shape); anything else becomes a dense
    parameter (a quantized layer's bias, a buffer of it)."""
    owner, attr = _module_and_attr(model, name)
    shard = plan.shard(name.rpartition(".")[0])
    qtype = GGMLQuantizationType[tensor.gguf_type]
    layer = None
    if (
        attr == "weight"
        and type(owner) is torch.nn.Linear
        and gguf_layout(tensor.gguf_type) != "dense"
    ):
        layer = gguf_weights.linear(raw, qtype, device, shard)
    if layer is not None:
        parent_name, _, child = name.removesuffix(".weight").rpartition(".")
        if owner.bias is not None and owner.bias.device.type != "meta":  # its bias came first
            layer.bias = owner.bias.detach()
        setattr(model.get_submodule(parent_name), child, layer)
        return
    meta_model.set_dense(owner, attr, shard.dense(attr, gguf_weights.dense(raw, qtype, dtype)))


def _head_as_stored(
    tensor: TensorInfo,
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    ranks: int,
) -> bool:
    """Whether `tensor` is a Q8_0 embedding that the output head is tied to and reads as stored: on
    a CPU, in a float32 model, where the dense head reads 4 bytes a weight. A bfloat16 model keeps
    its packed bfloat16 head: 2 bytes a weight, and from a few rows on, oneDNN's bfloat16 GEMM beats
    the 8-bit tiles (a 2-core Xeon with AMX, SmolLM2's head: 1.8 against 8.8 ms at 32 rows)."""
    return (
        dtype == torch.float32
        and tensor.name == "token_embd.weight"
        and tensor.gguf_type in EXACT_INT8_TYPES
        and int8_groups_cpu.fits(tensor.shape[-1])
        and bool(getattr(config, "tie_word_embeddings", False))
        and device.type == "cpu"
        and ranks == 1
        and int8_groups_cpu.runs()
    )


def load(
    path: Path,
    config: PretrainedConfig,
    dtype: torch.dtype,
    attention: str,
    device: torch.device,
    ranks: int = 1,
) -> torch.nn.Module:
    """The model of `config` (read from the same file) in eval mode: its quantized layers on
    `device`, the rest on the CPU (the caller moves it); with `ranks` > 1, this rank's part of it
    (node_agent/model/linear_shards.py)."""
    header = gguf_header.read(path)
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config.to_dict())
    model = meta_model.empty(config, dtype, attention)
    plan = Plan.of(model, ranks)
    with _one_name_map():
        names = get_gguf_hf_weights_map(model, processor)
    head = None  # a tied head's codes and scales, where it reads them as stored
    with open(path, "rb") as file:
        block = None
        for tensor in header.tensors:
            if (
                this_block := _block(tensor.name)
            ) != block:  # what the last block's temporaries freed (none
                meta_model.return_freed_pages()  # outlives its placing), once a block (a tensor: 2 s of an 8 s load)
                block = this_block
            found = processor.process(weights=_read(file.fileno(), tensor), name=tensor.name)
            if found.name in names:
                _place(model, names[found.name], found.weights, tensor, dtype, device, plan)
                if _head_as_stored(tensor, config, dtype, device, ranks):
                    head = gguf_weights.int8_groups(found.weights)
        meta_model.return_freed_pages()
    model = meta_model.filled(model, config, path.name)
    if head is not None:
        model.set_output_embeddings(int8_groups_cpu.CpuInt8GroupLinear(*head, None))
    plan.sum_rows(model)
    return model
