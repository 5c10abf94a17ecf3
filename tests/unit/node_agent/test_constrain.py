"""Constrained decoding on a tiny random model: whatever the weights say, rows with a grammar
produce output that matches it, and rows without one are untouched."""

import json

import pytest

from gateway.dialects.tools.grammars import forced_call_grammar, json_grammar
from gateway.dialects.tools.parsers import parse
from node_agent.engine.engine import Engine
from node_agent.serving import prompts
from shared.errors import InvalidRequest
from shared.wire import GenerationRequest
from tests.unit.node_agent.engine_driver import add, request, run

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
        },
    },
    {
        "name": "ping",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
]


@pytest.mark.slow  # decodes under a grammar one token a step (~20 s)
def test_json_schema_output_validates(tiny_llama):
    profile, lm = tiny_llama
    grammar = json_grammar(SCHEMA)
    reqs = [
        request(f"j{i}", p, temperature=t, seed=i, max_tokens=60, grammar=grammar)
        for i, (p, t) in enumerate([("Hi", 0), ("Give me JSON", 1.0), ("x", 0.7)])
    ]
    results = run(Engine(lm, profile), *reqs)
    for req in reqs:
        value = json.loads(results[req.job].text[0])
        assert (
            set(value) == {"ok", "color"}
            and isinstance(value["ok"], bool)
            and value["color"] in ("red", "green")
        )
        assert (
            results[req.job].finish[0] == "stop"
        )  # the grammar ended, then EOS was the only choice


def test_json_object_output_parses(tiny_llama):
    profile, lm = tiny_llama
    req = request("j", "Hi", temperature=0, max_tokens=200, grammar=json_grammar(None))
    result = run(Engine(lm, profile), req)["j"]
    if result.finish[0] == "stop":
        assert isinstance(json.loads(result.text[0]), dict)
    else:  # out of tokens mid-object: still a prefix the grammar allows
        assert result.text[0].startswith("{")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_forced_tool_call_parses_as_a_call(tiny_llama, parser):
    profile, lm = tiny_llama
    grammar = forced_call_grammar(parser, TOOLS, parallel=False)
    result = run(
        Engine(lm, profile),
        request("j", "Call a tool", temperature=0, max_tokens=60, grammar=grammar),
    )["j"]
    parsed = parse(parser, result.text[0])
    assert parsed.content == "" and len(parsed.calls) == 1
    call = parsed.calls[0]
    assert call.name in ("set_unit", "ping")
    args = json.loads(call.arguments)
    assert args == {} if call.name == "ping" else args["unit"] in ("c", "f")


def test_masks_only_touch_rows_with_a_grammar(tiny_llama):
    profile, lm = tiny_llama
    free = request("free", "Tell me a story", temperature=0, max_tokens=16, ignore_eos=True)
    alone = run(Engine(lm, profile), free)["free"].token_ids[0]
    engine = Engine(lm, profile)
    constrained = request(
        "c", "JSON please", temperature=0, max_tokens=30, grammar=json_grammar(SCHEMA)
    )
    results = run(
        engine,
        constrained,
        request("free", "Tell me a story", temperature=0, max_tokens=16, ignore_eos=True),
    )
    assert results["free"].token_ids[0] == alone
    json.loads(results["c"].text[0])


def test_a_grammar_that_does_not_compile_is_a_400(tiny_llama):
    profile, lm = tiny_llama
    with pytest.raises(InvalidRequest):
        add(Engine(lm, profile), request("j", "Hi", grammar='start: %json {"type": 5}'))


def test_stop_sequence_is_reported(tiny_llama):
    profile, lm = tiny_llama
    greedy = run(
        Engine(lm, profile), request("a", "Hi", temperature=0, max_tokens=12, ignore_eos=True)
    )["a"].text[0]
    stop = greedy[4:7]
    result = run(
        Engine(lm, profile),
        request("b", "Hi", temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
    )["b"]
    assert result.finish[0] == "stop"


def test_templates_without_tools_get_them_in_hermes_form(smol_tokenizer, tiny_llama):
    profile, _ = tiny_llama
    req = GenerationRequest(
        job="j",
        model="m",
        kind="chat",
        tools=[{"type": "function", "function": TOOLS[0]}],
        messages=[
            {"role": "user", "content": "unit?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "set_unit", "arguments": '{"unit": "c"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
    )
    text = smol_tokenizer.decode(prompts.prompt_ids(smol_tokenizer, profile, req))
    assert "<tools>" in text and '"name": "set_unit"' in text
    assert '<tool_call>\n{"name": "set_unit", "arguments": {"unit": "c"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\ndone\n</tool_response>" in text
