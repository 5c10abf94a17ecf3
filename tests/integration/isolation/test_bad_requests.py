"""Every bad request the attacker's report listed, in both dialects: each gets its status in the
dialect's error shape (or, where the request is fine for the device, an answer), while an
innocent stream on the same node runs through to its last token."""

import json
import threading

import httpx
import openai
import pytest

from tests.integration.isolation.conftest import MAX_REQUEST_BYTES, MODEL

pytestmark = pytest.mark.integration

INNOCENT_TOKENS = 24
BIG = 2**70
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "not-a-type"}}}
HUGE = "x" * (MAX_REQUEST_BYTES + 1)

# (path, body, status); a 200 is a request the device takes fine (its floats underflow harmlessly)
CASES = {
    "logit_bias beyond the vocabulary": (
        "/v1/completions",
        COMPLETION | {"logit_bias": {"99999": 5}},
        400,
    ),
    "prompt token beyond the vocabulary": (
        "/v1/completions",
        COMPLETION | {"prompt": [99999]},
        400,
    ),
    "negative prompt token": ("/v1/completions", COMPLETION | {"prompt": [-1]}, 400),
    "empty prompt": ("/v1/completions", COMPLETION | {"prompt": ""}, 400),
    "top_p underflows": ("/v1/completions", COMPLETION | {"top_p": 1e-50}, 200),
    "temperature underflows": ("/v1/chat/completions", CHAT | {"temperature": 1e-320}, 200),
    "temperature beyond float32 (ollama)": (
        "/api/generate",
        {
            "model": MODEL,
            "prompt": "0",
            "stream": True,
            "logprobs": True,
            "options": {
                "temperature": 6.293853914943464e307,
                "top_k": 576.0,
                "seed": -1657755.0,
                "num_predict": 4,
                "frequency_penalty": 6.555421306584769e-11,
                "presence_penalty": 0.06601988241297319,
            },
        },
        200,
    ),
    "repetition_penalty underflows": (
        "/v1/completions",
        COMPLETION | {"repetition_penalty": 1e-300},
        200,
    ),
    "keep_alive 1e308": ("/v1/chat/completions", CHAT | {"keep_alive": 1e308}, 400),
    "keep_alive in hours overflows": (
        "/v1/completions",
        COMPLETION | {"keep_alive": "999999999h"},
        400,
    ),
    "seed over 64 bits": ("/v1/chat/completions", CHAT | {"seed": BIG}, 400),
    "stop_token_ids over 64 bits": ("/v1/completions", COMPLETION | {"stop_token_ids": [BIG]}, 400),
    "prompt token over 64 bits": ("/v1/completions", COMPLETION | {"prompt": [BIG]}, 400),
    "seed 2**64-1 with n=2": ("/v1/chat/completions", CHAT | {"seed": 2**64 - 1, "n": 2}, 400),
    "chat_template_kwargs tokenize": (
        "/v1/chat/completions",
        CHAT | {"chat_template_kwargs": {"tokenize": True}},
        400,
    ),
    "stream_options without stream": (
        "/v1/chat/completions",
        CHAT | {"stream_options": {"include_usage": True}},
        400,
    ),
    "five stop strings": ("/v1/chat/completions", CHAT | {"stop": ["a", "b", "c", "d", "e"]}, 400),
    "tool with an invalid schema": (
        "/v1/chat/completions",
        CHAT
        | {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
        400,
    ),
    "body over the limit (openai)": ("/v1/completions", COMPLETION | {"prompt": HUGE}, 413),
    "prompt too long to tokenise": (
        "/v1/completions",
        COMPLETION | {"prompt": "word " * 150_000},
        400,
    ),
    "huge integer inside a tool schema": (
        "/v1/messages/count_tokens",
        {
            "model": MODEL,
            "messages": MESSAGES["messages"],
            "tools": [{"name": "f", "input_schema": {"type": "object", "x": BIG}}],
        },
        400,
    ),
    "max_tokens over 64 bits": ("/v1/messages", MESSAGES | {"max_tokens": BIG}, 400),
    "100 stop_sequences": (
        "/v1/messages",
        MESSAGES | {"stop_sequences": [f"s{i}" for i in range(100)]},
        400,
    ),
    "tool with an invalid input_schema": (
        "/v1/messages",
        MESSAGES | {"tools": [{"name": "f", "input_schema": BAD_SCHEMA}]},
        400,
    ),
    "count_tokens of only redacted_thinking": (
        "/v1/messages/count_tokens",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "redacted_thinking", "data": "x"}]}],
        },
        400,
    ),
    "body over the limit (anthropic)": ("/v1/messages", MESSAGES | {"system": HUGE}, 413),
    "prompt token beyond the vocabulary (chat logit_bias)": (
        "/v1/chat/completions",
        CHAT | {"logit_bias": {"99999": -5}},
        400,
    ),
}


class Innocent(threading.Thread):
    """A sampled stream of INNOCENT_TOKENS tokens, counted by their logprobs (a token lost on the way
    shows as fewer than its usage says); `started` is set once its first token arrived."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.client = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120
        )
        self.started = threading.Event()
        self.tokens, self.finish_reason, self.usage, self.error = 0, None, None, None

    def run(self) -> None:
        try:
            for chunk in self.client.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                stream=True,
                max_tokens=INNOCENT_TOKENS,
                temperature=0.7,
                logprobs=0,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ):
                for choice in chunk.choices:
                    self.tokens += len(choice.logprobs.tokens) if choice.logprobs else 0
                    self.finish_reason = choice.finish_reason or self.finish_reason
                self.usage = chunk.usage or self.usage
                self.started.set()
        except Exception as exc:  # reported by the test
            self.error = exc
            self.started.set()


def _assert_error_shape(path: str, status: int, body: dict) -> None:
    if path.startswith("/v1/messages"):
        kind = "request_too_large" if status == 413 else "invalid_request_error"
        assert (
            body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
        ), body
    else:
        error = body["error"]
        assert error["message"] and error["type"] == "invalid_request_error" and error["code"], body


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_fails_alone(stack, case):
    path, body, status = CASES[case]
    innocent = Innocent(stack.gateway_url)
    innocent.start()
    assert innocent.started.wait(60), "the innocent stream never started"
    response = httpx.post(
        f"{stack.gateway_url}{path}",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == status, response.text
    if status >= 400:
        _assert_error_shape(path, status, response.json())
    innocent.join(120)
    assert innocent.error is None and not innocent.is_alive()
    assert innocent.tokens == innocent.usage.completion_tokens == INNOCENT_TOKENS
    assert innocent.finish_reason == "length"


def test_nothing_left_behind(stack):
    """After every case: no job pending, no subscription leaked, the model still ready."""
    stack.assert_clean()
    assert stack.client().pubsub_channels(stack.keys.events("*")) == []
    assert stack.models_on("n1")[MODEL]["state"] == "ready"
