"""The architectures Cortex serves, each with the attention implementation it runs with.

Every one is tested token for token against full-forward greedy decoding under continuous
batching with chunked prefill (tests/unit/node_agent/test_architectures.py); any other is
refused at load, so none ever runs silently wrong. Adding one means adding it to that test's
matrix (tests/tiny_models.py ARCHITECTURES) first.
"""

from shared.model_files import ModelLoadError

ATTENTION = {  # model_type -> attn_implementation
    "llama": "sdpa",
    "mistral": "sdpa",
    "mixtral": "sdpa",
    "qwen2": "sdpa",
    "qwen3": "sdpa",
    "qwen3_moe": "sdpa",
    "qwen3_5_text": "sdpa",
    "qwen3_next": "sdpa",
    "gemma2": "eager",  # its attention logits are soft-capped, which only the eager implementation does
    "gemma3_text": "sdpa",
    "phi3": "sdpa",
    "olmo2": "sdpa",
    "granite": "sdpa",
}


def attention_implementation(model_type: str) -> str:
    """The attention implementation of a tested architecture; refuses any other."""
    if model_type not in ATTENTION:
        raise ModelLoadError(f"model_type '{model_type}' is not among the architectures Cortex has tested; "
                             f"supported: {', '.join(sorted(ATTENTION))}")
    return ATTENTION[model_type]
