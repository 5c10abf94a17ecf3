"""Vision models (transformers' image-text-to-text classes): their processor, and a prompt's
embeddings with its images merged in.

The processor runs in the tokenising thread pool (`prompts.vision_prompt`): it expands each image
placeholder into the model's image tokens and turns the images into arrays (numpy, so no tensor
leaves the device thread's side). At admission, on the device thread, `embed_prompt` runs the
vision tower once per job and scatters its features over the image tokens' embeddings; prefill
then reads slices of those embeddings chunk by chunk, exactly as it reads token ids for text.
Models with multimodal rotary positions (Qwen2.5-VL's M-RoPE) also get the prompt's 3-D rope
positions and the offset (`rope_delta`, negative after an image) that maps a cache column to its
rope position for every token generated after the prompt. Models whose image tokens attend to
each other both ways (Gemma 3) get each image's span: prefill never splits one across chunks, and
its tokens see to its end.
"""

import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, PretrainedConfig
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

from node_agent.model import architectures

log = logging.getLogger(__name__)

BIDIRECTIONAL_IMAGES = {
    "gemma3"
}  # an image's tokens attend to each other both ways (HF's token_type_ids masks)
_TEXT_INPUTS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"}


def is_vision(config: PretrainedConfig) -> bool:
    return config.model_type in architectures.VISION


def load_processor(folder: Path) -> Any:
    """The model's processor. transformers builds a video processor for models that read video,
    and that needs torchvision; without it, the processor is built from its tokenizer and image
    processor alone (this node reads images, never video)."""
    try:
        return AutoProcessor.from_pretrained(folder)
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise
    model_type = transformers.AutoConfig.from_pretrained(folder).model_type
    processor_class = getattr(transformers, PROCESSOR_MAPPING_NAMES[model_type])

    def check(self, name: str, argument: Any) -> Any:
        return (
            None
            if argument is None
            else processor_class.check_argument_for_proper_class(self, name, argument)
        )

    image_only = type(
        processor_class.__name__, (processor_class,), {"check_argument_for_proper_class": check}
    )
    parts = {name: None for name in processor_class.get_attributes()}
    template = folder / "chat_template.jinja"
    log.info(
        "torchvision is not installed: %s's processor is built without its video processor",
        model_type,
    )
    return image_only(
        **parts
        | {
            "tokenizer": AutoTokenizer.from_pretrained(folder),
            "image_processor": AutoImageProcessor.from_pretrained(folder),
        },
        chat_template=template.read_text() if template.exists() else None,
    )


@dataclass
class VisionPrompt:
    """One job's prompt as the language model reads it: embeddings with the images merged in."""

    embeds: torch.Tensor  # [L, H]
    rope: torch.Tensor | None = (
        None  # [3, L] M-RoPE positions; None: the cache columns are the positions
    )
    rope_delta: int = 0  # rope position minus cache column for every token after the prompt
    # Images whose tokens attend both ways: their [start, end) spans, which a prefill chunk never
    # splits, and for each prompt token the last position it sees (its image's end, else itself).
    blocks: list[tuple[int, int]] = field(default_factory=list)
    sees_until: torch.Tensor | None = None

    def chunk(self, start: int, length: int) -> int:
        """The length of the chunk from `start` (at most `length`, unless an image starting there is
        longer) that ends outside every bidirectional image."""
        end = start + length
        for block_start, block_end in self.blocks:
            if block_start < end < block_end:
                return block_start - start if block_start > start else block_end - start
        return length


def _blocks(flags: list[bool]) -> list[tuple[int, int]]:
    """The [start, end) runs of image tokens."""
    runs, start = [], None
    for i, flag in enumerate(flags + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def bidirectional_spans(config: PretrainedConfig, prompt_ids: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of image tokens that attend to each other both ways (none for models
    whose image tokens read causally)."""
    if config.model_type not in BIDIRECTIONAL_IMAGES:
        return []
    token = image_token_id(config)
    return _blocks([i == token for i in prompt_ids])


def _call(method: Any, arrays: dict[str, torch.Tensor], **fixed: Any) -> Any:
    """Call a model method with the processor outputs it takes by name."""
    names = inspect.signature(method).parameters
    return method(**{k: v for k, v in arrays.items() if k in names}, **fixed)


def _image_features(model: torch.nn.Module, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    images = {k: v for k, v in arrays.items() if k not in _TEXT_INPUTS}
    out = _call(model.model.get_image_features, images)
    features = getattr(out, "pooler_output", None)
    features = out if features is None else features
    if isinstance(features, (list, tuple)):
        features = torch.cat(list(features))
    return features.reshape(-1, features.shape[-1])


def image_token_id(config: PretrainedConfig) -> int:
    token = getattr(config, "image_token_id", None)
    return token if token is not None else config.image_token_index


def embed_prompt(
    model: torch.nn.Module,
    prompt_ids: list[int],
    images: dict[str, np.ndarray],
    device: torch.device,
) -> VisionPrompt:
    """Run the vision tower over a prompt's images and merge the features into its embeddings."""
    ids = torch.tensor(prompt_ids, device=device)
    arrays = {k: torch.from_numpy(np.asarray(v)).to(device) for k, v in images.items()}
    embeds = model.get_input_embeddings()(ids)
    features = _image_features(model, arrays).to(embeds.dtype)
    placeholders = ids == image_token_id(model.config)
    if int(placeholders.sum()) != features.shape[0]:
        raise ValueError(
            f"the prompt has {int(placeholders.sum())} image tokens for {features.shape[0]} image features"
        )
    embeds = embeds.clone()
    embeds[placeholders] = features
    if model.config.model_type in BIDIRECTIONAL_IMAGES:
        blocks = _blocks(placeholders.tolist())
        sees_until = torch.arange(len(prompt_ids), device=device)
        for start, end in blocks:
            sees_until[start:end] = end - 1
        return VisionPrompt(embeds=embeds, blocks=blocks, sees_until=sees_until)
    rope_index = getattr(model.model, "get_rope_index", None)
    if rope_index is None:
        return VisionPrompt(embeds=embeds)
    text = {k: v for k, v in arrays.items() if k in _TEXT_INPUTS} | {"input_ids": ids[None]}
    rope, delta = _call(rope_index, {**arrays, **text})
    return VisionPrompt(embeds=embeds, rope=rope[:, 0], rope_delta=int(delta.reshape(-1)[0]))
