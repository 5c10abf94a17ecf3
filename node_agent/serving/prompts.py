"""Requests to prompt token ids: the model's own chat template (jinja2, through the tokenizer),
with `tools` and `chat_template_kwargs`, or ChatML for models without one. A template that
does not render tools gets them in the Hermes format (a system block listing them, calls as
`<tool_call>` text, results as `<tool_response>` text), which the gateway's `hermes` parser reads.
A vision model renders with its processor's template and reads the job's images through its
processor (`vision_prompt`)."""

import io
import json
from typing import Any

import jinja2
import numpy as np
from PIL import Image
from transformers import PreTrainedTokenizerBase

from shared.catalog import ModelProfile
from shared.errors import ContextLengthExceeded, InvalidRequest
from shared.wire import RENDERING_KWARGS, GenerationRequest

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
            raise InvalidRequest(
                f"unsupported content part type {part.get('type')!r}", param="messages"
            )
    return "".join(parts)


def _content(content: Any, images: bool) -> Any:
    """Content as the template reads it: text, or (for a vision model) text and image parts in order."""
    if not (
        images and isinstance(content, list) and any(p.get("type") == "image" for p in content)
    ):
        return _text_of(content)
    out = []
    for part in content:
        if part.get("type") not in ("text", "image"):
            raise InvalidRequest(
                f"unsupported content part type {part.get('type')!r}", param="messages"
            )
        out.append(
            {"type": "image"}
            if part["type"] == "image"
            else {"type": "text", "text": part.get("text", "")}
        )
    return out


def chat_template(tokenizer: PreTrainedTokenizerBase, profile: ModelProfile) -> str | None:
    """The template to render with; None lets the tokenizer pick from its own (string or named set,
    `tool_use` when tools are given)."""
    if profile.force_chatml or not (profile.chat_template or tokenizer.chat_template):
        return CHATML_TEMPLATE
    return profile.chat_template


HERMES_TOOLS_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


def _arguments(arguments: Any) -> Any:
    """Call arguments as templates expect them: an object, not OpenAI's JSON string."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _template_renders_tools(tokenizer: PreTrainedTokenizerBase, profile: ModelProfile) -> bool:
    template = chat_template(tokenizer, profile) or tokenizer.chat_template or ""
    if isinstance(template, dict):  # a named set: its `tool_use` template renders them
        return "tool_use" in template or any("tools" in t for t in template.values())
    return "tools" in template


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """Tools, calls and results written into the messages as Hermes-format text."""
    out = [dict(m) for m in messages]
    if tools:
        block = HERMES_TOOLS_SYSTEM.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        )
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    for message in out:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [
                json.dumps(
                    {
                        "name": c["function"]["name"],
                        "arguments": _arguments(c["function"]["arguments"]),
                    },
                    ensure_ascii=False,
                )
                for c in message.pop("tool_calls")
            ]
            text = "\n".join(f"<tool_call>\n{call}\n</tool_call>" for call in calls)
            message["content"] = f"{message['content']}\n{text}".strip()
        elif message["role"] == "tool":
            message.pop("tool_call_id", None)
            message.update(
                role="user", content=f"<tool_response>\n{message['content']}\n</tool_response>"
            )
    return out


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token stands for: a text longer than `tokens * this` cannot fit in
    `tokens`, so it can be refused without tokenising it."""
    return max(len(token) for token in tokenizer.get_vocab())


def _check_chars(text: str, max_chars: int | None) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise ContextLengthExceeded(
            f"the prompt has {len(text)} characters; no prompt over {max_chars} characters "
            "fits this model's context",
            param="messages",
        )


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    profile: ModelProfile,
    request: GenerationRequest,
    max_chars: int | None = None,
) -> list[int]:
    """The prompt's token ids; a text over `max_chars` is refused before it is tokenised."""
    if request.kind == "completion":
        if isinstance(request.prompt, list):
            return list(request.prompt)
        _check_chars(request.prompt or "", max_chars)
        return tokenizer.encode(request.prompt or "", add_special_tokens=True)
    return tokenizer.encode(
        _chat_text(tokenizer, profile, request, max_chars), add_special_tokens=False
    )


def _image(data: bytes, index: int) -> Image.Image:
    """One of the job's images (the gateway checked it), first frame, as RGB."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"image {index} cannot be read: {exc}", param="messages") from None


def vision_prompt(
    processor: Any, profile: ModelProfile, request: GenerationRequest, max_chars: int | None = None
) -> tuple[list[int], dict[str, np.ndarray]]:
    """A vision model's prompt: token ids with each image's tokens expanded by the processor, and
    the processor's image inputs (pixel values, grids) as arrays; none for a prompt without images."""
    if request.kind == "completion":
        return prompt_ids(processor.tokenizer, profile, request, max_chars), {}
    text = _chat_text(processor, profile, request, max_chars, images=True)
    if not request.images:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    placeholders = sum(
        1
        for m in request.messages or []
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if p.get("type") == "image"
    )
    if placeholders != len(request.images):
        raise InvalidRequest(
            f"the messages hold {placeholders} image parts for {len(request.images)} images",
            param="messages",
        )
    images = [_image(data, i) for i, data in enumerate(request.images)]
    inputs = dict(
        processor(text=[text], images=images, add_special_tokens=False, return_tensors="np")
    )
    ids = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)
    return ids, inputs


def _chat_text(
    renderer: Any,
    profile: ModelProfile,
    request: GenerationRequest,
    max_chars: int | None,
    images: bool = False,
) -> str:
    """The chat prompt rendered by `renderer`'s template: a tokenizer's, or (`images`) a vision
    model's processor's, which keeps image parts in place."""
    messages = [
        {**m, "content": _content(m.get("content"), images)} for m in request.messages or []
    ]
    tools = request.tools
    if _template_renders_tools(renderer, profile):
        for message in messages:
            for call in message.get("tool_calls") or []:
                call["function"] = {
                    **call["function"],
                    "arguments": _arguments(call["function"]["arguments"]),
                }
    else:
        messages, tools = hermes_messages(messages, tools), None
    if not messages:
        raise InvalidRequest(
            "messages: nothing to render (no message has content the model can read)",
            param="messages",
        )
    extra = {k: v for k, v in request.chat_template_kwargs.items() if k not in RENDERING_KWARGS}
    try:
        text = renderer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=chat_template(renderer, profile),
            add_generation_prompt=request.add_generation_prompt,
            tokenize=False,
            **extra,
        )
    except (
        jinja2.TemplateError
    ) as exc:  # the template itself refused these messages (raise_exception)
        raise InvalidRequest(
            f"messages: the model's chat template refused them: {exc}", param="messages"
        ) from None
    _check_chars(text, max_chars)
    return text
