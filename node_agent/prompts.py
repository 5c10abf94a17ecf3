"""Requests to prompt token ids: the model's own chat template (jinja2, through the tokenizer),
with `tools` and `chat_template_kwargs`, or ChatML for models without one."""

from typing import Any

from transformers import PreTrainedTokenizerBase

from shared.catalog import ModelProfile
from shared.errors import InvalidRequest
from shared.wire import GenerationRequest

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _text_of(content: Any) -> str:
    """Message content as text: a string, or text parts joined; images need a vision model."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") == "text":
            parts.append(part.get("text", ""))
        elif part.get("type") in ("image_url", "image"):
            raise InvalidRequest("this model is text-only and cannot read images", param="messages")
        else:
            raise InvalidRequest(f"unsupported content part type {part.get('type')!r}", param="messages")
    return "".join(parts)


def chat_template(tokenizer: PreTrainedTokenizerBase, profile: ModelProfile) -> str | None:
    """The template to render with; None lets the tokenizer pick from its own (string or named set,
    `tool_use` when tools are given)."""
    if profile.force_chatml or not (profile.chat_template or tokenizer.chat_template):
        return CHATML_TEMPLATE
    return profile.chat_template


def prompt_ids(tokenizer: PreTrainedTokenizerBase, profile: ModelProfile, request: GenerationRequest) -> list[int]:
    if request.kind == "completion":
        if isinstance(request.prompt, list):
            return list(request.prompt)
        return tokenizer.encode(request.prompt or "", add_special_tokens=True)
    messages = [{**m, "content": _text_of(m.get("content"))} for m in request.messages or []]
    text = tokenizer.apply_chat_template(
        messages,
        tools=request.tools,
        chat_template=chat_template(tokenizer, profile),
        add_generation_prompt=request.add_generation_prompt,
        tokenize=False,
        **request.chat_template_kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=False)
