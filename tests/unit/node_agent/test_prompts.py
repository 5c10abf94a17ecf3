import pytest

from node_agent.serving import prompts
from shared.catalog import ModelProfile
from shared.errors import InvalidRequest
from shared.wire import GenerationRequest

TEMPLATE_WITH_EXTRAS = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
    "{% if enable_thinking %}<think>{% endif %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def chat(messages, **kw) -> GenerationRequest:
    return GenerationRequest(job="j", model="m", kind="chat", messages=messages, **kw)


def render(tokenizer, profile, request) -> str:
    return tokenizer.decode(prompts.prompt_ids(tokenizer, profile, request))


def test_models_own_template_is_used(smol_tokenizer):
    text = render(
        smol_tokenizer, ModelProfile(id="m", source="x"), chat([{"role": "user", "content": "Hi"}])
    )
    assert "<|im_start|>system" in text  # SmolLM2's template adds its default system prompt
    assert text.endswith("<|im_start|>assistant\n")


def test_template_override_gets_tools_and_kwargs(smol_tokenizer):
    profile = ModelProfile(id="m", source="x", chat_template=TEMPLATE_WITH_EXTRAS)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = render(
        smol_tokenizer,
        profile,
        chat(
            [{"role": "user", "content": "Hi"}],
            tools=tools,
            chat_template_kwargs={"enable_thinking": True},
        ),
    )
    assert text == "TOOLS:get_weather;[user]Hi\n<think>[assistant]"  # HF renders with trim_blocks


def test_named_template_set_picks_tool_use_when_tools_are_given(smol_tokenizer):
    tokenizer = smol_tokenizer
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = {
            "default": "{% for m in messages %}D:{{ m.content }}{% endfor %}",
            "tool_use": "{% for m in messages %}T:{{ m.content }}{% endfor %}",
        }
        profile = ModelProfile(id="m", source="x")
        assert render(tokenizer, profile, chat([{"role": "user", "content": "Hi"}])) == "D:Hi"
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        assert (
            render(tokenizer, profile, chat([{"role": "user", "content": "Hi"}], tools=tools))
            == "T:Hi"
        )
    finally:
        tokenizer.chat_template = saved


def test_chatml_fallback_when_forced(smol_tokenizer):
    profile = ModelProfile(id="m", source="x", force_chatml=True)
    text = render(smol_tokenizer, profile, chat([{"role": "user", "content": "Hi"}]))
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_content_parts_join_and_images_are_refused(smol_tokenizer):
    profile = ModelProfile(id="m", source="x", force_chatml=True)
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert "Hello there" in render(
        smol_tokenizer, profile, chat([{"role": "user", "content": parts}])
    )
    with pytest.raises(InvalidRequest, match="text-only"):
        prompts.prompt_ids(
            smol_tokenizer,
            profile,
            chat(
                [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AA=="},
                            }
                        ],
                    }
                ]
            ),
        )
