"""Bounds both dialects put on request fields, set to what the wire and a node can take: every
integer fits msgpack's 64 bits (token ids and counts far less), `keep_alive` is finite and
bounded, tool and output schemas are valid JSON Schema, and `chat_template_kwargs` cannot
change how the prompt is rendered. Token ids are checked against the model's vocabulary on the
node (`node_agent.engine.engine.Engine.add`), which fails that job alone with a 400."""

from typing import Annotated, Any, Literal

from jsonschema import SchemaError
from jsonschema.validators import validator_for
from pydantic import AfterValidator, Field

from shared.wire import RENDERING_KWARGS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1  # no vocabulary comes near; the node checks the model's own size
MAX_TOKENS_MAX = 2**31 - 1
KEEP_ALIVE_MAX_S = 7 * 24 * 3600.0  # a request may hold its model loaded at most a week after it
STOP_TOKEN_IDS_MAX = 64
LOGIT_BIAS_MAX = 300  # OpenAI's limit on biased tokens

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_MAX)]
TopK = Annotated[int, Field(ge=-1, le=TOKEN_ID_MAX)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=STOP_TOKEN_IDS_MAX)]
# vLLM's `cache_salt`: prompts share cached prefixes only with prompts of the same salt (and scope,
# `prefix_cache_scope`); its length is bounded, as every string that reaches a node's hashing
CacheSalt = Annotated[str, Field(min_length=1, max_length=256)]
# speculative decoding for one request (shared/wire.py SamplingParams): a method, or None for the catalogue's
Speculative = Literal["off", "ngram", "suffix"] | None
SpeculativeTokens = Annotated[int, Field(ge=1, le=64)] | None
KeepAliveSeconds = Annotated[
    float, Field(ge=-KEEP_ALIVE_MAX_S, le=KEEP_ALIVE_MAX_S, allow_inf_nan=False)
]


def _valid_schema(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A JSON Schema its own meta-schema accepts (a tool's parameters, an output format)."""
    if schema is not None:
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            raise ValueError(f"is not a valid JSON Schema: {exc.message}") from None
    return schema


JsonSchema = Annotated[dict[str, Any], AfterValidator(_valid_schema)]


def _plain_rendering(kwargs: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(RENDERING_KWARGS & kwargs.keys())
    if taken:
        raise ValueError(
            f"may not set {', '.join(taken)}: the gateway decides how the prompt is rendered"
        )
    return kwargs


ChatTemplateKwargs = Annotated[dict[str, Any], AfterValidator(_plain_rendering)]


_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def duration_s(value: float | str | None) -> float | None:
    """Ollama's `keep_alive`: seconds, or a string such as "90", "5m", "1h"."""
    if value is None or isinstance(value, (int, float)):
        return value
    unit = value[-1] if value[-1] in _UNIT_S else "s"
    return float(value.rstrip("smh")) * _UNIT_S[unit]


def _bounded_duration(value: str) -> str:
    if not abs(duration_s(value)) <= KEEP_ALIVE_MAX_S:
        raise ValueError(f"must be within {KEEP_ALIVE_MAX_S:g} seconds either way")
    return value


KeepAlive = (
    KeepAliveSeconds
    | Annotated[
        str, Field(pattern=r"^-?\d{1,12}(\.\d{1,9})?[smh]?$"), AfterValidator(_bounded_duration)
    ]
    | None
)
