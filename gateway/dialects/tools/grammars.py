"""Grammars for constrained decoding: what a request constrains (data the protocol modules
return: a forced tool call, or JSON output) → a lark grammar llguidance compiles on the node.

A forced call is written in the model's own tool-call format (`parsers.ParserName`), so the
parser that reads the answer back is the one that reads unconstrained answers.
"""

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from gateway.dialects.tools.parsers import ParserName
from shared.errors import InvalidRequest


@dataclass(frozen=True)
class ForcedCall:
    """The answer must be a call of one of `tools` (`[{"name", "parameters"}]`); 1 to
    MAX_PARALLEL_CALLS of them if `parallel`."""

    tools: list[dict[str, Any]]
    parallel: bool

    @classmethod
    def of(cls, tools: list[dict[str, Any]], named: str | None, parallel: bool) -> "ForcedCall":
        """A call of the tool `named`, else of any of `tools`; several only if `parallel` and none is named."""
        return cls(
            [t for t in tools if named in (None, t["name"])], parallel=named is None and parallel
        )


@dataclass(frozen=True)
class JsonOutput:
    """The answer must be a JSON object (validating against `schema` when one is given);
    `param` is the request field that asked for it, named in a 400."""

    schema: dict[str, Any] | None
    param: str


Constraint = ForcedCall | JsonOutput | None


# Compact JSON (no free whitespace): a small model cannot wander into endless blanks.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    return schema if "x-guidance" in schema else {**schema, "x-guidance": _COMPACT}


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(_compact(schema), ensure_ascii=False)


def _closed(parameters: dict[str, Any]) -> dict[str, Any]:
    """A forced call names only the declared arguments (as OpenAI's strict mode does), unless
    the tool's schema says otherwise: a small model must not invent keys forever."""
    if parameters.get("type") == "object" and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def _call_schema(tools: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """Tools `[{"name", "parameters"}]` → a schema for one call object of any of them."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                args_key: _closed(t.get("parameters") or {"type": "object"}),
            },
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


MAX_PARALLEL_CALLS = (
    4  # a forced answer holds at most this many calls: a small model would not stop
)


def forced_call_grammar(parser: ParserName, tools: list[dict[str, Any]], *, parallel: bool) -> str:
    """A grammar whose every sentence is exactly one call (or, if `parallel`, 1 to
    MAX_PARALLEL_CALLS calls) of `tools`, in the model's own format."""

    def calls(first: str, separator: str) -> str:
        return (
            f'{first} ("{separator}" {first}){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else first
        )

    if parser == "hermes":
        call = '"<tool_call>\\n" obj "\\n</tool_call>"'
        start = calls("call", "\\n")
        return f"start: {start}\ncall: {call}\nobj: {_json_rule(_call_schema(tools, 'arguments'))}"
    if parser == "llama3_json":
        return f"start: {calls('obj', '; ')}\nobj: {_json_rule(_call_schema(tools, 'parameters'))}"
    return (
        f'start: "[" {calls("obj", ", ")} "]"\nobj: {_json_rule(_call_schema(tools, "arguments"))}'
    )


def json_grammar(schema: dict[str, Any] | None) -> str:
    """Any JSON object (`json_object`), or one that validates against `schema`."""
    return f"start: {_json_rule(schema if schema is not None else {'type': 'object'})}"


def checked(grammar: str, param: str) -> str:
    """The grammar, if llguidance can compile it; a 400 naming `param` otherwise."""
    error = llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar))
    if error:
        raise InvalidRequest(
            f"{param}: cannot be used for constrained decoding: {error.strip()}", param=param
        )
    return grammar


def grammar(constraint: Constraint, tool_format: ParserName) -> str | None:
    """The grammar a request's constraint decodes under (None: unconstrained); a 400 naming the
    request field when llguidance cannot compile it."""
    if isinstance(constraint, ForcedCall):
        return checked(
            forced_call_grammar(tool_format, constraint.tools, parallel=constraint.parallel),
            "tools",
        )
    if isinstance(constraint, JsonOutput):
        return checked(json_grammar(constraint.schema), constraint.param)
    return None
