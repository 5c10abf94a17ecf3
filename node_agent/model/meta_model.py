"""A model built with empty (meta) parameters for a loader to fill tensor by tensor, so that the
host never holds a second, full-precision copy (node_agent/model/gguf_loader.py,
quantized_checkpoint.py), and the check that the loader filled it all."""

import ctypes

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from shared.model_files import ModelLoadError

_MALLOC_TRIM = getattr(
    ctypes.CDLL(None), "malloc_trim", None
)  # glibc's; None under another C library


def empty(config: PretrainedConfig, dtype: torch.dtype, attention: str) -> torch.nn.Module:
    """The model of `config`, its parameters on meta and its buffers (rotary frequencies) real."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)


def set_dense(module: torch.nn.Module, attr: str, value: torch.Tensor) -> None:
    """A tensor as the module's buffer where it has one of that name, else as a frozen parameter."""
    if attr in module._buffers:
        module._buffers[attr] = value
    else:
        setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))


def filled(model: torch.nn.Module, config: PretrainedConfig, source: str) -> torch.nn.Module:
    """The model in eval mode, its output head tied where `config` ties it; a ModelLoadError naming
    what `source` left empty."""
    if config.tie_word_embeddings:
        model.tie_weights()
    empty_tensors = [
        name
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type == "meta"
    ]
    if empty_tensors:
        raise ModelLoadError(
            f"{source} has no tensors for {', '.join(empty_tensors[:5])}"
            f"{' …' if len(empty_tensors) > 5 else ''}"
        )
    return model.eval()


def return_freed_pages() -> None:
    """Hand the pages that a loader's freed temporaries left in the C heap back to the system, where
    the C library can (glibc): else the heap keeps them as slack between the long-lived weights."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
