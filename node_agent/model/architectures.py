"""The architectures Cortex serves, each with the attention implementation it runs with.

Every text one is tested token for token against full-forward greedy decoding under continuous
batching with chunked prefill (tests/unit/node_agent/test_architectures.py), every vision one
against HF on the same processed image inputs (tests/unit/node_agent/test_vision.py); any other
is refused at load, so none ever runs silently wrong. Adding one means adding it to its test's
matrix (tests/tiny_models.py ARCHITECTURES or VISION_ARCHITECTURES) first.
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

# Vision models (image-text-to-text; node_agent/model/vision.py). Others are refused rather than run
# wrong (Qwen3-VL's deepstack features, for one, need more).
VISION = {"qwen2_5_vl": "sdpa", "idefics3": "sdpa", "qwen3_5": "sdpa", "gemma3": "sdpa"}


def attention_implementation(model_type: str) -> str:
    """The attention implementation of a tested architecture (text or vision); refuses any other."""
    tested = ATTENTION | VISION
    if model_type not in tested:
        raise ModelLoadError(
            f"model_type '{model_type}' is not among the architectures Cortex has tested; "
            f"supported: {', '.join(sorted(tested))}"
        )
    return tested[model_type]
