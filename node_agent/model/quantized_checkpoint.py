"""Load a safetensors checkpoint that config.json's `quantization_config` marks AWQ, GPTQ or FP8
(fine-grained "fp8" as Qwen3-*-FP8 ships, or compressed-tensors' float8) without transformers'
quantizers, which need packages a node does not have (autoawq, gptqmodel) or a GPU.

As the GGUF loader does (node_agent/model/gguf_loader.py): the model is built with empty (meta)
parameters, and each tensor is read from the files on its own. A Linear whose weight the
checkpoint quantizes becomes the quantized layer node_agent/model/checkpoint_weights.py makes
of its tensors (quant "auto"), or a dense Linear of its dequantised weight (any other quant);
every other tensor (embeddings, norms, an output head or layer left unquantized) loads dense
in the model's dtype. Under "auto" the host holds no more at full precision than one Linear's
float32 temporaries at a time: each tensor's bytes are read on their own (pread: no mapping of the
files stays resident), and the pages a Linear's temporaries freed go back to the system after it
(glibc's malloc_trim; else the heap kept them as slack between the long-lived quantized weights:
on 8 layers of hidden 1024, 384 MiB at float32, an FP8 load held 320 MiB of it at the end).
What the load adds at its peak is bounded by tests/unit/node_agent/test_checkpoint_quant.py."""

import copy
import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PretrainedConfig

from node_agent.model import checkpoint_weights, meta_model
from node_agent.model.checkpoint_weights import FourBit
from node_agent.model.linear_shards import Plan, Shard
from node_agent.model.quantized_linear import eight_bit
from shared.model_files import ModelLoadError
from shared.weight_formats import (
    CHECKPOINT_METHODS,
    FP8_DTYPE,
    PACKED_4BIT,
    SIDE_TENSORS,
    checkpoint_method,
)

_FP8_SCALES = ("weight_scale_inv", "weight_scale")  # fine-grained fp8's, compressed-tensors'


def method(config: PretrainedConfig) -> str:
    """The checkpoint's quantization this loader reads ("awq", "gptq", "fp8", "compressed-tensors"),
    "" where it has none or one transformers loads itself."""
    if getattr(config, "quantization_config", None) is None:
        return ""
    found = checkpoint_method({"quantization_config": _settings(config)})
    return found if found in CHECKPOINT_METHODS else ""


def _refuse_unread(settings: dict) -> None:
    """A ModelLoadError for a variant of a method this loader does not read."""
    kind = settings["quant_method"]
    if kind in ("awq", "gptq") and settings.get("bits", 4) != 4:
        raise ModelLoadError(f"{kind} checkpoints are read at 4 bits only, not {settings['bits']}")
    if kind == "awq" and settings.get("zero_point") is False:
        raise ModelLoadError(
            "AWQ checkpoints without zero points (zero_point = false) are not read"
        )
    if kind == "awq" and str(settings.get("version", "gemm")).lower() != "gemm":
        raise ModelLoadError(
            f"AWQ's '{settings['version']}' layout is not read; only 'gemm' (AutoAWQ's default)"
        )
    if kind == "compressed-tensors":
        weights = [
            group.get("weights") or {} for group in (settings.get("config_groups") or {}).values()
        ]
        if not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
            raise ModelLoadError(
                "of compressed-tensors checkpoints only float8 weights are read (config_groups' "
                "weights: type 'float', num_bits 8)"
            )


def _fp8_block(settings: dict) -> tuple[int, int] | None:
    """The rows x columns one FP8 scale covers where the config says (a block-wise checkpoint);
    None where the scale's shape says it (per tensor, per channel)."""
    if settings["quant_method"] == "fp8":
        block = settings.get("weight_block_size")
    else:
        block = next(
            (
                group["weights"].get("block_structure")
                for group in settings["config_groups"].values()
                if group["weights"].get("strategy") == "block"
            ),
            None,
        )
    return tuple(block) if block else None


# safetensors' dtype names, as torch's
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    FP8_DTYPE: torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class _Stored(NamedTuple):
    """Where a tensor lies in a safetensors file, and what it is."""

    fd: int
    offset: int
    size: int
    dtype: str
    shape: list[int]


class _Files:
    """Every tensor of a folder's safetensors files, read one at a time by name: its bytes alone,
    with pread (a mapping of the file, as safe_open keeps, would hold every page read resident in
    the process until the load ends: the checkpoint's size again)."""

    def __init__(self, folder: Path, stack: ExitStack):
        self.where: dict[str, _Stored] = {}
        for path in sorted(folder.glob("*.safetensors")):
            fd = os.open(path, os.O_RDONLY)
            stack.callback(os.close, fd)
            self.where |= self._header(fd)
        if not self.where:
            raise ModelLoadError(f"{folder} has no .safetensors files")

    @staticmethod
    def _header(fd: int) -> dict[str, _Stored]:
        """A file's tensors, from its header: 8 bytes of its length, then JSON of each tensor's
        dtype, shape and offsets from the header's end."""
        length = int.from_bytes(os.pread(fd, 8, 0), "little")
        entries = json.loads(os.pread(fd, length, 8))
        entries.pop("__metadata__", None)
        return {
            name: _Stored(
                fd,
                8 + length + e["data_offsets"][0],
                e["data_offsets"][1] - e["data_offsets"][0],
                e["dtype"],
                e["shape"],
            )
            for name, e in entries.items()
        }

    def read(self, name: str) -> torch.Tensor:
        stored = self.where[name]
        data = bytearray(stored.size)
        view, offset = memoryview(data), stored.offset
        while view:  # (one read returns at most 2 GiB)
            count = os.preadv(stored.fd, [view], offset)
            if not count:
                raise ModelLoadError(f"{name} ends past the end of its file")
            view, offset = view[count:], offset + count
        if not data:  # (torch.frombuffer takes no empty buffer)
            return torch.empty(stored.shape, dtype=_DTYPES[stored.dtype])
        return torch.frombuffer(data, dtype=_DTYPES[stored.dtype]).reshape(stored.shape)

    def dtype(self, name: str) -> str:
        return self.where[name].dtype

    def by_owner(self) -> dict[str, set[str]]:
        """Module name -> the attributes the files hold for it."""
        owners: dict[str, set[str]] = {}
        for name in self.where:
            owner, _, attr = name.rpartition(".")
            owners.setdefault(owner, set()).add(attr)
        return owners


def _weight(
    files: _Files, owner: str, attrs: set[str], settings: dict
) -> FourBit | torch.Tensor | None:
    """A Linear's quantized weight, as 4-bit groups (AWQ, GPTQ) or dequantised (FP8); None where the
    checkpoint keeps it dense."""
    kind = settings["quant_method"]
    group_size = settings.get("group_size", 128)
    if PACKED_4BIT in attrs and kind == "awq":
        return checkpoint_weights.awq(
            *(files.read(f"{owner}.{a}") for a in ("qweight", "qzeros", "scales")), group_size
        )
    if PACKED_4BIT in attrs and kind == "gptq":
        gptq_format = str(
            settings.get("checkpoint_format") or settings.get("format") or "gptq"
        ).lower()
        g_idx = files.read(f"{owner}.g_idx") if "g_idx" in attrs else None
        return checkpoint_weights.gptq(
            *(files.read(f"{owner}.{a}") for a in ("qweight", "qzeros", "scales")),
            g_idx,
            group_size,
            zero_offset=0 if gptq_format == "gptq_v2" else 1,
        )
    scale = next((a for a in _FP8_SCALES if a in attrs), None)
    if "weight" in attrs and scale and files.dtype(f"{owner}.weight") == FP8_DTYPE:
        return checkpoint_weights.fp8(
            files.read(f"{owner}.weight"), files.read(f"{owner}.{scale}"), _fp8_block(settings)
        )
    if attrs & {PACKED_4BIT, "weight_packed"}:
        raise ModelLoadError(
            f"{owner}: its {kind} tensors ({', '.join(sorted(attrs))}) are not read"
        )
    return None


def _place_dense(
    model: torch.nn.Module,
    owner: str,
    attrs: set[str],
    files: _Files,
    dtype: torch.dtype,
    shard: Shard,
) -> None:
    """A module's tensors the checkpoint keeps dense (this rank's `shard` of them), floating point
    ones in `dtype`; a tensor the model has no place for is left (as transformers leaves unexpected keys)."""
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return
    for attr in sorted(a for a in attrs if hasattr(module, a)):
        value = shard.dense(attr, files.read(f"{owner}.{attr}"))
        meta_model.set_dense(module, attr, value.to(dtype) if value.is_floating_point() else value)


def _place_linear(
    model: torch.nn.Module,
    owner: str,
    weight: FourBit | torch.Tensor,
    bias: torch.Tensor | None,
    keep_quantized: bool,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard,
) -> None:
    """This rank's `shard` of a quantized Linear weight (and its bias) into the model: the layer
    that runs it quantized on `device`, or (not `keep_quantized`, or a 4-bit layer whose inputs are
    not whole groups) its dequantised weight in `dtype`. A bias the model's layer has no place for
    is left, as transformers leaves it (AutoGPTQ saves one, zeros, for every layer)."""
    try:
        linear = model.get_submodule(owner)
    except AttributeError:
        linear = None
    if type(linear) is not torch.nn.Linear:
        raise ModelLoadError(
            f"{owner} is quantized in the checkpoint but is no Linear layer of transformers' "
            f"{type(model).__name__} (fused experts?): only Linear layers are read quantized"
        )
    bias = None if linear.bias is None or bias is None else shard.dense("bias", bias)
    if keep_quantized:
        on_device = None if bias is None else bias.to(device)
        layer = (
            weight.shard(shard).layer(on_device, device)
            if isinstance(weight, FourBit)
            else eight_bit(weight.to(device), on_device, shard)
        )
        if layer is not None:
            parent, _, child = owner.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
            return
    dense = weight.dequantised() if isinstance(weight, FourBit) else weight
    meta_model.set_dense(linear, "weight", shard.dense("weight", dense).to(dtype))
    if bias is not None:
        meta_model.set_dense(linear, "bias", bias)


def _place(
    model: torch.nn.Module,
    owner: str,
    attrs: set[str],
    files: _Files,
    settings: dict,
    keep_quantized: bool,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard,
) -> None:
    """Module `owner`'s tensors into the model: a Linear the checkpoint quantizes as `_place_linear`
    makes it, any other module's tensors dense."""
    weight = _weight(files, owner, attrs, settings)
    if weight is None:
        _place_dense(model, owner, attrs - SIDE_TENSORS, files, dtype, shard)
        return
    bias = files.read(f"{owner}.bias").to(dtype) if "bias" in attrs else None
    _place_linear(model, owner, weight, bias, keep_quantized, dtype, device, shard)


def _settings(config: PretrainedConfig) -> dict:
    quantization = config.quantization_config
    return quantization if isinstance(quantization, dict) else quantization.to_dict()


def load(
    folder: Path,
    config: PretrainedConfig,
    dtype: torch.dtype,
    attention: str,
    device: torch.device,
    keep_quantized: bool,
    ranks: int = 1,
) -> torch.nn.Module:
    """The model of `config` (its `quantization_config` one `method` reads) in eval mode, its
    quantized Linear layers kept quantized on `device` or dequantised to `dtype`, the rest on the
    CPU (the caller moves it); with `ranks` > 1, this rank's part of it
    (node_agent/model/linear_shards.py). Its config no longer carries the quantization_config."""
    settings = _settings(config)
    _refuse_unread(settings)
    plain = copy.deepcopy(config)
    del plain.quantization_config  # else transformers would look for the method's own layers
    model = meta_model.empty(plain, dtype, attention)
    plan = Plan.of(model, ranks)
    with ExitStack() as stack:
        files = _Files(folder, stack)
        for owner, attrs in files.by_owner().items():
            _place(
                model,
                owner,
                attrs,
                files,
                settings,
                keep_quantized,
                dtype,
                device,
                plan.shard(owner),
            )
            meta_model.return_freed_pages()  # (what the module's temporaries freed: none outlives its placing)
    model = meta_model.filled(model, plain, folder.name)
    plan.sum_rows(model)
    return model
