"""Ollama's API through the official `ollama` Python client, against a real stack behind an API key
(sent as `Authorization: Bearer`): chat streamed and not, generate (templated and raw), a tool round
trip, `format` with a schema, embed, list, show, ps, pull, errors. Every greedy answer equals what
`/v1/chat/completions` (or `/v1/completions` for a raw prompt) gives for the same request. And the
calls VS Code's Copilot Chat makes to discover models, replayed without a key as it sends none."""

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import numpy as np
import ollama
import openai
import pytest

from gateway.dialects.protocol import ollama as protocol_ollama
from tests import tiny_poolers
from tests.integration.clients.conftest import ANSWER, OLLAMA_ADMIN_KEY, unknown_fields
from tests.stack import wait_for

HI = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "num_predict": 8}
BASH = {
    "type": "function",
    "function": {
        "name": "Bash",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
ASK_FILES = [{"role": "user", "content": "What files are here?"}]


@pytest.fixture(autouse=True)
def every_field_known(keyed_stack) -> Iterator[None]:
    """No field the client sends is one the gateway does not know (it would be ignored)."""
    log = keyed_stack.stack.root / "gateway.log"
    since = len(log.read_text().splitlines())
    yield
    assert unknown_fields(log, since, set(vars(protocol_ollama))) == []


@pytest.fixture
def client(keyed_stack) -> ollama.Client:
    return ollama.Client(host=keyed_stack.url, headers=keyed_stack.bearer)


@pytest.fixture
def reference(keyed_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{keyed_stack.url}/v1", api_key=keyed_stack.key, max_retries=0)


def greedy(reference: openai.OpenAI, model: str = "tiny", messages: list = HI, **extra):
    return reference.chat.completions.create(
        **{"model": model, "messages": messages, "temperature": 0, "max_tokens": 8} | extra
    )


@pytest.mark.parametrize("name", ["tiny", "tiny:latest", "default"])
def test_chat_equals_the_openai_answer(client, reference, name):
    expected = greedy(reference)
    whole = client.chat(model=name, messages=HI, options=GREEDY)
    streamed = list(client.chat(model=name, messages=HI, options=GREEDY, stream=True))
    text = expected.choices[0].message.content or ""
    assert whole.message.content == "".join(chunk.message.content for chunk in streamed) == text
    assert [chunk.done for chunk in streamed] == [False] * (len(streamed) - 1) + [True]
    for final in (whole, streamed[-1]):
        assert final.done_reason == expected.choices[0].finish_reason
        assert (final.prompt_eval_count, final.eval_count) == (
            expected.usage.prompt_tokens,
            expected.usage.completion_tokens,
        )
        assert (
            final.total_duration
            >= final.load_duration + final.prompt_eval_duration + final.eval_duration - 3
        )
        assert final.prompt_eval_duration > 0 and final.model == name


def test_generate_equals_the_openai_answers(client, reference):
    templated = client.generate(model="tiny", prompt="Hello there", options=GREEDY)
    assert templated.response == (greedy(reference).choices[0].message.content or "")
    raw = client.generate(model="tiny", prompt="Hello there", raw=True, options=GREEDY)
    plain = reference.completions.create(
        model="tiny", prompt="Hello there", temperature=0, max_tokens=8
    )
    assert raw.response == plain.choices[0].text and raw.eval_count == plain.usage.completion_tokens
    streamed = list(
        client.generate(model="tiny", prompt="Hello there", options=GREEDY, stream=True)
    )
    assert "".join(chunk.response for chunk in streamed) == templated.response and streamed[-1].done


def test_tool_round_trip(client, reference):
    first = client.chat(model="scripted", messages=ASK_FILES, tools=[BASH])
    [call] = first.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("Bash", {"command": "ls"})
    [openai_call] = (
        greedy(reference, "scripted", ASK_FILES, tools=[BASH], max_tokens=64)
        .choices[0]
        .message.tool_calls
    )
    assert (openai_call.function.name, json.loads(openai_call.function.arguments)) == (
        "Bash",
        {"command": "ls"},
    )
    streamed = [
        c
        for chunk in client.chat(model="scripted", messages=ASK_FILES, tools=[BASH], stream=True)
        for c in chunk.message.tool_calls or []
    ]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        ("Bash", {"command": "ls"})
    ]
    result = {"role": "tool", "content": "notes.txt", "tool_name": "Bash"}
    second = client.chat(
        model="scripted", messages=[*ASK_FILES, first.message, result], tools=[BASH]
    )
    assert second.message.content == ANSWER and not second.message.tool_calls


def test_format_with_a_schema(client, reference):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    reply = client.chat(
        model="tiny", messages=HI, format=schema, options={"temperature": 0, "num_predict": 40}
    )
    assert isinstance(json.loads(reply.message.content)["ok"], bool)
    expected = reference.chat.completions.create(
        model="tiny",
        messages=HI,
        temperature=0,
        max_tokens=40,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        },
    )
    assert reply.message.content == expected.choices[0].message.content


def test_list_show_and_ps(client, keyed_stack):
    assert {"tiny:latest", "default:latest", "scripted:latest"} <= {
        m.model for m in client.list().models
    }
    shown = client.show("default")
    assert shown.capabilities == ["completion", "tools"]
    assert shown.modelinfo[f"{shown.modelinfo['general.architecture']}.context_length"] == 256
    assert shown.modelinfo["general.basename"] == "tiny" and "num_ctx 256" in shown.parameters
    assert (
        client.generate(model="tiny", keep_alive="10m").done_reason == "load"
    )  # how Ollama's clients preload
    assert client.chat(model="tiny", messages=[]).done_reason == "load"
    client.chat(model="tiny", messages=HI, options=GREEDY, keep_alive="1h")

    def running() -> dict:
        return {m.model: m for m in client.ps().models}

    wait_for(
        lambda: running()["tiny:latest"].expires_at > datetime.now(UTC) + timedelta(minutes=50),
        10,
        "the node's heartbeat to keep tiny for the hour asked (not the catalogue's 5 minutes)",
    )
    assert running()["tiny:latest"].context_length == 256 and running()["tiny:latest"].size > 0
    assert keyed_stack.stack.models_on("node-o")["tiny"]["state"] == "ready"


def test_embed(client, ollama_embedder):
    texts = ["Hello there", "The sea"]
    expected = tiny_poolers.reference_vectors(ollama_embedder, texts).numpy()
    answer = client.embed(model="embed", input=texts)
    np.testing.assert_allclose(np.array(answer.embeddings), expected, atol=1e-4)
    np.testing.assert_allclose(
        np.array(client.embeddings(model="embed", prompt=texts[0]).embedding),
        expected[0],
        atol=1e-4,
    )
    assert "embedding" in client.show("embed").capabilities


def test_pull_and_errors(client, keyed_stack):
    admin = ollama.Client(
        host=keyed_stack.url, headers={"Authorization": f"Bearer {OLLAMA_ADMIN_KEY}"}
    )
    assert [p.status for p in admin.pull("tiny", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as not_admin:  # pulling fills the nodes' disks
        client.pull("tiny")
    assert not_admin.value.status_code == 403 and "admin key" in not_admin.value.error
    with pytest.raises(ollama.ResponseError) as missing:
        admin.pull("llama3.2")
    assert (
        missing.value.status_code == 404
        and "pulling models is not available yet" in missing.value.error
    )
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat(model="no-such-model", messages=HI)
    assert unknown.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as text_only:
        client.chat(model="tiny", messages=[HI[0] | {"images": [b"\x89PNG not really"]}])
    assert text_only.value.status_code == 400 and "text-only" in text_only.value.error
    with pytest.raises(ollama.ResponseError) as no_key:
        ollama.Client(host=keyed_stack.url).list()
    assert no_key.value.status_code == 401


def test_vscode_copilot_chat_discovers_models(stack, openai_client):
    """What Copilot Chat's Ollama provider (src/extension/byok/vscode-node/ollamaProvider.ts) asks,
    as it asks it (no key), and the fields it reads; then a chat by the listed name on
    /v1/chat/completions, where Copilot sends its requests."""
    url = stack.gateway_url
    version = httpx.get(f"{url}/api/version").json()["version"]
    assert tuple(int(part) for part in version.split(".")) >= (
        0,
        6,
        4,
    )  # its MINIMUM_OLLAMA_VERSION
    models = httpx.get(f"{url}/api/tags").json()["models"]
    assert {"tiny:latest", "default:latest", "scripted:latest"} <= {m["model"] for m in models}
    for model in models:
        shown = httpx.post(
            f"{url}/api/show",
            json={"model": model["model"]},
            headers={"Content-Type": "application/json"},
        )
        assert shown.status_code == 200, shown.text
        info = shown.json()
        context = info["model_info"][f"{info['model_info']['general.architecture']}.context_length"]
        assert isinstance(context, int) and context > 0
        assert isinstance(info["model_info"]["general.basename"], str) and isinstance(
            info["template"], str
        )
        assert "tools" in info["capabilities"] and "vision" not in info["capabilities"]
        assert isinstance(info["details"]["family"], str)
    listed = next(m["model"] for m in models if m["model"] == "tiny:latest")
    reply = openai_client.chat.completions.create(model=listed, messages=HI, max_tokens=4)
    assert reply.model == "tiny" and reply.usage.completion_tokens > 0
