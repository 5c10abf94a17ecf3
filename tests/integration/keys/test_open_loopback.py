"""With no API key and the gateway on loopback, auth is off: the README's curl examples (and SDKs
sending any key) work exactly as they did before keys existed. Its own stack: no key may exist."""

import json
import subprocess

import httpx
import openai
import pytest

from tests.integration.batch.conftest import MODEL
from tests.integration.keys.conftest import cortex_keys

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def curl(*args: str) -> str:
    return subprocess.run(
        ["curl", "-sS", "--fail-with-body", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout


def test_the_readme_examples_need_no_key(keys_stack):
    assert "No API keys" in cortex_keys(keys_stack, "list").stdout
    base, json_header = keys_stack.replicas[0], ("-H", "Content-Type: application/json")
    streamed = curl(
        "-N",
        f"{base}/v1/chat/completions",
        *json_header,
        "-d",
        json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "temperature": 0,
                "max_tokens": 8,
                "messages": QUESTION,
            }
        ),
    )
    assert streamed.startswith("id: 0\ndata: {") and streamed.rstrip().endswith(
        "data: [DONE]"
    )  # numbered frames
    answer = json.loads(
        curl(
            f"{base}/v1/chat/completions",
            *json_header,
            "-d",
            json.dumps({"model": MODEL, "temperature": 0, "max_tokens": 8, "messages": QUESTION}),
        )
    )
    assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] >= 1
    completion = json.loads(
        curl(
            f"{base}/v1/completions",
            *json_header,
            "-d",
            json.dumps(
                {
                    "model": MODEL,
                    "prompt": "The capital of France is",
                    "max_tokens": 8,
                    "temperature": 0,
                }
            ),
        )
    )
    assert completion["choices"][0]["text"]
    assert MODEL in [m["id"] for m in json.loads(curl(f"{base}/v1/models"))["data"]]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4).choices
    assert (
        httpx.get(f"{base}/admin/keys").status_code == 401
    )  # the admin API needs the admin key even so
    keys_stack.assert_clean()
