"""Find a model's files and load it with transformers: local dirs and files, the Hugging Face
cache (offline), safetensors, GGUF, and files shipped inside Python packages. Vision models load
through the image-text-to-text class, with their processor (node_agent/model/vision.py)."""

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    DistributedConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from node_agent.model import (
    architectures,
    cpu_attention,
    devices,
    fused_layers,
    gguf_loader,
    int4_tiles,
    kernel_paths,
    packed_linear,
    quantized_checkpoint,
    quantized_linear,
    vision,
)
from shared import gguf_header
from shared.catalog import ModelProfile
from shared.model_files import ModelFiles, ModelLoadError, locate

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    context_len: int
    tp_size: int = 1  # ranks the weights are sharded over (tensor parallelism)
    group: object | None = (
        None  # rank 0 of a tensor-parallel model: its node_agent.tp.tensor_parallel.RankGroup
    )
    processor: object | None = None  # a vision model's processor (its tokenizer is `tokenizer`)
    quant: str = (
        "none"  # how its Linear weights are held (quantized_linear.held_as): "int4", "int8", …
    )
    weight_bytes: int = 0  # what its weights hold on the device (one rank's, when tensor-parallel)
    kernels: str = ""  # which kernels its matmuls run, in words (node_agent/model/kernel_paths.py)


def _architecture(
    files: ModelFiles, profile: ModelProfile, header: Path | None
) -> tuple[PretrainedConfig, str]:
    """The model's config (from `header`, a GGUF file's config kept apart, when there is one) and
    the attention implementation its (tested) architecture runs with."""
    config = (
        AutoConfig.from_pretrained(header)
        if header is not None and header.exists()
        else AutoConfig.from_pretrained(files.folder, gguf_file=files.gguf_file)
    )
    if profile.vision and not vision.is_vision(config):
        raise ModelLoadError(
            f"the catalogue says {profile.id} reads images (vision = true), but its model_type "
            f"'{config.model_type}' is not a supported vision model; supported: "
            f"{', '.join(sorted(architectures.VISION))}"
        )
    return config, architectures.attention_implementation(config.model_type)


def _converted_copy(files: ModelFiles, cache_dir: Path | None, what: str) -> Path | None:
    """Where `what` of a GGUF file is kept, so later loads skip the slow unpacking: a dequantised
    copy (`what` its dtype's name), or its config and tokenizer alone ("header", for a model whose
    weights load as stored)."""
    if not (files.gguf_file and cache_dir):
        return None
    stat = (files.folder / files.gguf_file).stat()
    return cache_dir / f"{Path(files.gguf_file).stem}-{stat.st_size}-{int(stat.st_mtime)}-{what}"


def _save_header(
    config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, target: Path
) -> None:
    """A GGUF file's config and tokenizer as a folder: reading them back takes a fraction of a
    second, where transformers parses the whole GGUF header (its vocabulary) for each."""
    partial = target.with_name(target.name + ".partial")
    config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def _save_converted(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, target: Path
) -> None:
    """transformers refuses to save a GGUF-loaded model until its quantizer marks are cleared."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def quantize_int8_dynamic(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU's int8: Linear layers with int8 weights per channel and activations quantized on the
    fly (fbgemm/oneDNN, VNNI where the CPU has it): on a 2-core EPYC 51 / 270 tok/s at N = 1 / 8 on the
    default model against 44 / 176 for the weight-only Int8Linear (docs/benchmarks.md)."""
    if model.dtype != torch.float32:
        raise ModelLoadError("quant = 'int8' on a CPU needs dtype float32 weights to quantise from")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    return quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, inplace=True)


def weights_as_stored(files: ModelFiles, profile: ModelProfile) -> bool:
    """Whether the model loads with its Linear weights quantized as its GGUF file stores them
    (quant = "auto" on a text model's file that quantizes them)."""
    if profile.quant != "auto" or not files.gguf_file or profile.vision:
        return False
    return gguf_loader.stores_quantized(files.folder / files.gguf_file)


def _tune_for_cpu(model: torch.nn.Module, profile: ModelProfile) -> None:
    """A CPU model's full-precision Linear weights packed for oneDNN (node_agent/model/packed_linear.py;
    quantized layers stay), its RMSNorms, gated MLPs and q/k/v projections fused (node_agent/model/fused_layers.py) and its
    decode attention reading the paged cache in place (node_agent/model/cpu_attention.py), its 4-bit
    layers bound to the node's int4 kernel (node_agent/model/int4_tiles.py), with a log line for
    each, or for why not."""
    log.info(
        "%s: %d RMSNorm, MLP and attention projection layers fused",
        profile.id,
        fused_layers.fuse(model),
    )
    why_not = packed_linear.packable(model)
    if why_not:
        log.info("%s: Linear layers run unpacked: %s", profile.id, why_not)
    else:
        log.info("%s: %d Linear layers packed for oneDNN", profile.id, packed_linear.pack(model))
    if bound := int4_tiles.bind(model):
        log.info("%s: %d 4-bit layers run the node's int4 kernel", profile.id, bound)
    if cpu_attention.enable(model):
        log.info("%s: decode attention reads the paged KV cache in place", profile.id)


_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
)
_SCALED_ROPE = (
    "yarn",
    "linear",
    "dynamic",
)  # types whose `factor` stretches the trained context (vLLM's rule)


def own_context(config: PretrainedConfig) -> int | None:
    """The longest sequence the model is made for: its config's positions, stretched by a RoPE
    scaling (yarn, linear, dynamic) its config sets; None when the config does not say."""
    trained = next(
        (value for key in _CONTEXT_KEYS if isinstance(value := getattr(config, key, None), int)),
        None,
    )
    rope = getattr(config, "rope_parameters", None) or {}
    if trained is None or rope.get("rope_type") not in _SCALED_ROPE or not rope.get("factor"):
        return trained
    base = rope.get("original_max_position_embeddings") if rope["rope_type"] == "yarn" else None
    return int((base or trained) * rope["factor"])


def _log_context(profile: ModelProfile, own: int | None) -> None:
    """The context a replica will run with, and why when it is not the catalogue's."""
    max_len, capped = profile.effective_context(own)
    if capped:
        log.warning(
            "%s runs with a context of %d tokens: %s; lower max_model_len to %d, or serve the model with a "
            "RoPE scaling (yarn) in its config.json if it supports one",
            profile.id,
            max_len,
            capped,
            own,
        )
    elif own is None:
        log.info(
            "%s runs with a context of %d tokens (max_model_len; its config does not give its own)",
            profile.id,
            max_len,
        )
    else:
        log.info(
            "%s runs with a context of %d tokens (max_model_len; its own is %d)",
            profile.id,
            max_len,
            own,
        )


def load(
    profile: ModelProfile,
    device: str,
    hf_cache: str | None = None,
    convert_cache: Path | None = None,
    tp_size: int = 1,
) -> LoadedModel:
    """Load on the calling thread (the device thread that will own the model). With `tp_size` > 1
    every rank calls this at once, in a process group already made (node_agent/tp/tensor_parallel.py),
    and gets its shard."""
    files = locate(profile, hf_cache)
    if files.gguf_file:  # its header read with bounds first: transformers' GGUF code trusts it
        gguf_header.read(files.folder / files.gguf_file)
    # a CPU's 8 bits, "fp8" too (it has no FP8 matmuls): torch's dynamic int8 (its layers do not shard)
    dynamic_int8 = profile.quant in ("int8", "fp8") and devices.is_cpu(device) and tp_size == 1
    dtype = _DTYPES.get(profile.dtype) or (
        torch.float32 if dynamic_int8 else devices.default_dtype(device)
    )
    as_stored = weights_as_stored(files, profile)
    converted = (
        None
        if as_stored
        else _converted_copy(files, convert_cache, str(dtype).removeprefix("torch."))
    )
    if converted is not None and converted.exists() and not files.tokenizer_folder:
        files = ModelFiles(folder=converted)
    header = (
        _converted_copy(files, convert_cache, "header")
        if as_stored and not files.tokenizer_folder
        else None
    )
    config, attention = _architecture(files, profile, header)
    log.info(
        "loading %s from %s (gguf=%s) as %s on %s",
        profile.id,
        files.folder,
        files.gguf_file,
        dtype,
        device,
    )
    tokenizer_from = files.tokenizer_folder or files.folder
    processor = vision.load_processor(files.folder) if vision.is_vision(config) else None
    if header is not None and header.exists():
        tokenizer = AutoTokenizer.from_pretrained(header)
    elif processor is not None:
        tokenizer = processor.tokenizer
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            tokenizer_from, gguf_file=None if files.tokenizer_folder else files.gguf_file
        )
    if header is not None and not header.exists():
        try:
            _save_header(config, tokenizer, header)
        except Exception as exc:  # a cache that cannot be written only costs time
            log.warning(
                "could not keep %s's config and tokenizer at %s: %s", files.gguf_file, header, exc
            )
    sharding = {"distributed_config": DistributedConfig(tp_size=tp_size)} if tp_size > 1 else {}
    model_class = AutoModelForImageTextToText if processor is not None else AutoModelForCausalLM
    quantized = quantized_checkpoint.method(config) if not files.gguf_file else ""
    if quantized and processor is not None:
        raise ModelLoadError(
            f"{profile.id}'s {quantized} checkpoint loads as a text model only: run it with "
            "vision = false"
        )
    if as_stored:
        model = gguf_loader.load(
            files.folder / files.gguf_file,
            config,
            dtype,
            attention,
            devices.torch_device(device),
            ranks=tp_size,
        )
    elif quantized:
        model = quantized_checkpoint.load(
            files.folder,
            config,
            dtype,
            attention,
            devices.torch_device(device),
            keep_quantized=profile.quant == "auto",
            ranks=tp_size,
        )
        log.info(
            "%s: %s checkpoint read %s",
            profile.id,
            quantized,
            "with its Linear weights quantized" if profile.quant == "auto" else "dequantised",
        )
    else:
        model = model_class.from_pretrained(
            files.folder,
            gguf_file=files.gguf_file,
            dtype=dtype,
            attn_implementation=attention,
            **sharding,
        )
    if converted is not None and files.gguf_file:
        try:
            _save_converted(model, tokenizer, converted)
        except Exception as exc:  # a cache that cannot be written only costs time
            log.warning(
                "could not keep a converted copy of %s at %s: %s", files.gguf_file, converted, exc
            )
    sharded_by_transformers = bool(sharding) and not (
        as_stored or quantized
    )  # it placed its shards itself
    model = (model if sharded_by_transformers else model.to(devices.torch_device(device))).eval()
    if dynamic_int8:
        model = quantize_int8_dynamic(model)
    elif profile.quant in quantized_linear.QUANTIZERS:
        log.info(
            "%s: %d Linear layers quantized to %s",
            profile.id,
            quantized_linear.quantize(model, profile.quant),
            profile.quant,
        )
    if not devices.is_cpu(device) and any(
        isinstance(m, quantized_linear.Int8Linear) for m in model.modules()
    ):
        # quant int8, Q6_K; FP8 without FP8 matmuls (Q8_0's 8-bit groups run on the int4 kernels)
        log.warning(
            "%s: 8-bit integer weights on a GPU save memory but decode several times slower than 'none' "
            "(ATen's int8 kernel; docs/operations.md): prefer quant = 'fp8' on a GPU with FP8 matmuls "
            "(Hopper, Ada, Blackwell), else 'int4' or 'none'",
            profile.id,
        )
    if devices.is_cpu(device) and tp_size == 1:
        _tune_for_cpu(model, profile)
    context = own_context(model.config.get_text_config())
    _log_context(profile, context)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=devices.torch_device(device),
        dtype=dtype,
        context_len=context or profile.max_model_len,
        tp_size=tp_size,
        processor=processor,
        quant="int8" if dynamic_int8 else quantized_linear.held_as(model),
        weight_bytes=quantized_linear.weight_bytes(model),
        kernels=kernel_paths.describe(model),
    )
