"""Tool-call parsers (every format, streamed in any chunking, gives the same text and calls) and
the grammars of forced calls."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dialects.tools import grammars as tool_grammars
from gateway.dialects.tools.parsers import (
    CallStart,
    Parsed,
    collect,
    make_parser,
    parse,
    parser_name,
)
from shared.catalog import ModelProfile

CASES = [
    (
        "hermes",
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": [1, {"a": "}"}]}}\n</tool_call>',
        "Sure.",
        [("get_weather", {"city": "Paris", "x": [1, {"a": "}"}]})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"arguments": {"q": 1}, "name": "b"}</tool_call>',
        "",
        [("a", {}), ("b", {"q": 1})],
    ),
    (
        "hermes",
        'Hello <tool_call>{"name": oops}</tool_call> bye',
        'Hello <tool_call>{"name": oops}</tool_call> bye',
        [],
    ),
    ("hermes", "just text with < and </ and <tool", "just text with < and </ and <tool", []),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"s": "a\\"}b"}}',
        "",
        [("f", {"s": 'a"}b'})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call>',
        "",
        [("f", {"k": 2})],
    ),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        "",
        [("f", {"a": 1}), ("g", {})],
    ),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    ("llama3_json", 'Hi there {"x":1}', 'Hi there {"x":1}', []),
    ("llama3_json", "{not json", "{not json", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
        "",
        [("f", {"a": 1}), ("g", {})],
    ),
    ("mistral", "[1, 2]", "[1, 2]", []),
    ("mistral", "Plain answer", "Plain answer", []),
]


def streamed(name: str, text: str, cuts: list[int]) -> Parsed:
    parser, pieces, last = make_parser(name), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces += parser.feed(text[last:cut])
        last = cut
    return collect(pieces + parser.finish())


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_answers(name, text, content, calls):
    parsed = parse(name, text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_chunking_gives_the_same_result(case, cuts):
    name, text, content, calls = case
    parsed = streamed(name, text, [c for c in cuts if c < len(text)])
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


def test_arguments_stream_before_the_call_ends():
    parser = make_parser("hermes")
    first = parser.feed('<tool_call>{"name": "f", "arguments": {"city": "Pa')
    assert isinstance(first[0], CallStart) and first[0].name == "f"
    assert "".join(p.text for p in first[1:]) == '{"city": "Pa'


@pytest.mark.parametrize(
    "profile, expected",
    [
        (ModelProfile(id="Qwen2.5-7B-Instruct", source="x"), "hermes"),
        (ModelProfile(id="m", source="hf:meta-llama/Llama-3.1-8B-Instruct"), "llama3_json"),
        (ModelProfile(id="Mistral-7B-Instruct-v0.3", source="x"), "mistral"),
        (ModelProfile(id="SmolLM2-135M-Instruct", source="x"), "hermes"),
        (ModelProfile(id="Llama-3-thing", source="x", tool_parser="hermes"), "hermes"),
    ],
)
def test_parser_by_family_and_catalogue_override(profile, expected):
    assert parser_name(profile) == expected


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_forced_call_grammars_compile(parser):
    tools = [
        {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"name": "g"},
    ]
    for parallel in (True, False):
        tool_grammars.grammar(tool_grammars.ForcedCall(tools, parallel=parallel), parser)


CUT_OFF = [  # answers that max_tokens ended inside a call: (parser, text, content, call names)
    ("hermes", "Sure <tool", "Sure", []),
    ("hermes", 'Sure <tool_call>\n{"arguments": {"city": "Pa', "Sure", []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"na', "", ["a"]),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"city": "Pa',
        "",
        ["f"],
    ),  # streamed already: a call
    ("llama3_json", '{"name": "f", "param', "", []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "argu', "", []),
]


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(CUT_OFF), cuts=st.lists(st.integers(0, 80), max_size=8))
def test_a_call_cut_off_by_max_tokens_is_never_text(case, cuts):
    name, text, content, names = case
    parser, pieces, last = make_parser(name), [], 0
    for cut in sorted({c for c in cuts if c < len(text)}) + [len(text)]:
        pieces += parser.feed(text[last:cut])
        last = cut
    parsed = collect(pieces + parser.finish(cut_off=True))
    assert parsed.content == content and [c.name for c in parsed.calls] == names


@pytest.fixture(scope="module")
def grammars(smol_tokenizer):
    from node_agent.engine.constrain import Grammars

    return Grammars(smol_tokenizer, len(smol_tokenizer), {smol_tokenizer.eos_token_id})


@pytest.mark.parametrize(
    "parser, one, separator",
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "\n"),
        ("llama3_json", '{"name": "f", "parameters": {}}', "; "),
    ],
)
def test_forced_calls_are_one_or_a_bounded_number(grammars, smol_tokenizer, parser, one, separator):
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {}}}]

    def accepts(text: str, parallel: bool) -> bool:
        matcher = grammars.matcher(
            tool_grammars.forced_call_grammar(parser, tools, parallel=parallel)
        )
        ids = smol_tokenizer.encode(text, add_special_tokens=False) + [smol_tokenizer.eos_token_id]
        return matcher.validate_tokens(ids) == len(ids)

    calls = lambda n: separator.join([one] * n)
    assert accepts(calls(1), parallel=False) and not accepts(calls(2), parallel=False)
    assert accepts(calls(tool_grammars.MAX_PARALLEL_CALLS), parallel=True)
    assert not accepts(calls(tool_grammars.MAX_PARALLEL_CALLS + 1), parallel=True)
