"""Ollama's `/api/*` routes against a scripted node on fakeredis: NDJSON streams and whole objects,
tool calls, errors in Ollama's shape, the model routes, pull, version and delete."""

import asyncio
import json

import httpx
import pytest

from gateway.http.server import create_app
from shared.catalog import DEFAULT_EMBEDDING_MODEL_ID, DEFAULT_MODEL_ID
from shared.errors import ModelNotFound
from shared.lifecycle import ModelState
from shared.settings import GatewaySettings
from shared.wire import DoneEvent, Timings, Usage
from tests.unit.gateway.conftest import KEYS, MODEL, ScriptedNode, beat, delta

ADMIN = "admin-secret"
ASK = {"model": "default:latest", "messages": [{"role": "user", "content": "Hi"}]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture
def settings() -> GatewaySettings:
    return GatewaySettings(
        redis_url="redis://fake", node_ttl_s=8.0, request_timeout_s=5.0, admin_key=ADMIN
    )


def timed_script(entry):
    return [
        delta("Hel"),
        delta("lo"),
        delta("!", finish_reason="stop"),
        DoneEvent(
            usage=Usage(prompt_tokens=5, completion_tokens=3),
            node="n1",
            timings=Timings(queue_ms=1.5, prefill_ms=2.0, decode_ms=4.0),
        ),
    ]


def lines(text: str) -> list[dict]:
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


async def test_chat_streams_ndjson_by_default(client, node):
    node.script = timed_script
    response = await client.post("/api/chat", json=ASK)
    assert response.headers["content-type"] == "application/x-ndjson"
    *pieces, last = lines(response.text)
    assert [p["message"] for p in pieces] == [
        {"role": "assistant", "content": t} for t in ("Hel", "lo", "!")
    ]
    assert all(p["done"] is False and p["model"] == "default:latest" for p in pieces)
    assert last | {"created_at": None} == {
        "model": "default:latest",
        "created_at": None,
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": "stop",
        "total_duration": 7_500_000,
        "load_duration": 1_500_000,
        "prompt_eval_count": 5,
        "prompt_eval_duration": 2_000_000,
        "eval_count": 3,
        "eval_duration": 4_000_000,
    }
    assert node.entries[0].model == MODEL and node.entries[0].request().kind == "chat"


async def test_json_under_any_content_type_as_curl_sends_it(client, node):
    body = json.dumps({"model": MODEL, "prompt": "Why?", "stream": False})
    answer = await client.post(
        "/api/generate", content=body, headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert answer.json()["response"] == "Hello!"


async def test_chat_not_streamed_is_the_stream_folded(client, node):
    node.script = timed_script
    streamed = lines((await client.post("/api/chat", json=ASK)).text)[-1]
    whole = (await client.post("/api/chat", json=ASK | {"stream": False})).json()
    assert whole["message"] == {"role": "assistant", "content": "Hello!"}
    assert whole | {"message": None, "created_at": None} == streamed | {
        "message": None,
        "created_at": None,
    }


async def test_chat_tool_call_goes_out_whole(client, node):
    node.script = lambda entry: [
        delta('<tool_call>\n{"name": "get_weather", '),
        delta('"arguments": {"city"'),
        delta(': "Paris"}}\n</tool_call>', finish_reason="stop"),
        DoneEvent(usage=Usage()),
    ]
    ask = ASK | {"tools": [WEATHER], "stream": False}
    message = (await client.post("/api/chat", json=ask)).json()["message"]
    [call] = message["tool_calls"]
    assert call["function"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}
    assert message["content"] == ""
    streamed = lines((await client.post("/api/chat", json=ask | {"stream": True})).text)
    assert [
        p["message"]["tool_calls"][0]["function"]["arguments"]
        for p in streamed
        if "tool_calls" in p["message"]
    ] == [{"city": "Paris"}]  # one object, once the call is whole
    assert node.entries[0].request().tools == [WEATHER]


async def test_generate_renders_the_prompt_as_a_user_turn(client, node):
    node.script = timed_script
    body = {
        "model": MODEL,
        "prompt": "Why?",
        "system": "Be brief.",
        "stream": False,
        "options": {"num_predict": 7},
    }
    answer = (await client.post("/api/generate", json=body)).json()
    assert (answer["response"], answer["done"], answer["done_reason"], answer["eval_count"]) == (
        "Hello!",
        True,
        "stop",
        3,
    )
    request = node.entries[0].request()
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
    ]
    assert request.sampling.max_tokens == 7
    *pieces, last = lines((await client.post("/api/generate", json=body | {"stream": True})).text)
    assert "".join(p["response"] for p in pieces) == "Hello!" and last["response"] == ""


async def test_think_splits_the_thinking_out_and_reaches_the_template(client, node):
    node.script = lambda entry: [
        delta("<think>x</think>\n\ny", finish_reason="stop"),
        DoneEvent(usage=Usage()),
    ]
    message = (await client.post("/api/chat", json=ASK | {"think": True, "stream": False})).json()[
        "message"
    ]
    assert (message["thinking"], message["content"]) == ("x", "y")
    assert node.entries[0].request().chat_template_kwargs == {"enable_thinking": True}


async def test_length_is_the_done_reason_of_a_cut_off_answer(client, node):
    node.script = lambda entry: [
        delta("Hel", finish_reason="length"),
        DoneEvent(usage=Usage(completion_tokens=1)),
    ]
    answer = (
        await client.post("/api/generate", json={"model": MODEL, "prompt": "x", "stream": False})
    ).json()
    assert answer["done_reason"] == "length"


@pytest.mark.parametrize(
    "path, body", [("/api/chat", {"model": "default"}), ("/api/generate", {"model": MODEL})]
)
async def test_nothing_to_generate_loads_the_model(client, redis, path, body):
    """Ollama's way to preload a model: placed on a node (a load command), answered at once."""
    await beat(redis, "n1", {}, free_mb=64_000)  # a live node holding nothing, with room

    async def load_when_told() -> None:
        while not await redis.xlen(KEYS.cmd("n1")):
            await asyncio.sleep(0.01)
        await beat(redis, "n1", {MODEL: ModelState.LOADING}, free_mb=64_000)

    loading = asyncio.create_task(load_when_told())
    answer = await client.post(path, json=body)
    await loading
    assert (answer.json()["done"], answer.json()["done_reason"]) == (True, "load")
    [(_, [(_, fields)])] = await redis.xread({KEYS.cmd("n1"): "0"})
    assert (fields[b"cmd"], fields[b"model"]) == (b"load", MODEL.encode())


async def test_format_schema_decodes_under_a_grammar(client, node):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    await client.post("/api/chat", json=ASK | {"format": schema, "stream": False})
    await client.post("/api/chat", json=ASK | {"format": "json", "stream": False})
    with_schema, any_object = (entry.request().sampling.grammar for entry in node.entries)
    assert '"required": ["name"]' in with_schema and '"type": "object"' in any_object


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/api/chat", ASK | {"model": "nope"}, 404, "The model 'nope' does not exist"),
        ("/api/chat", ASK | {"messages": [{"role": "robot"}]}, 400, "messages.0.role"),
        ("/api/chat", ASK | {"options": {"temperature": -1}}, 400, "options.temperature"),
        ("/api/chat", ASK | {"format": {"type": "nonsense"}}, 400, "format"),
        (
            "/api/generate",
            {"model": MODEL, "prompt": "x", "suffix": "y"},
            400,
            "suffix: fill-in-the-middle",
        ),
        ("/api/show", {"model": "nope:7b"}, 404, "does not exist"),
        ("/api/pull", {"model": "llama3"}, 404, "pulling models is not available yet: 'llama3'"),
    ],
)
async def test_errors_in_ollamas_shape(client, node, path, body, status, words):
    response = await client.post(path, json=body)
    assert response.status_code == status
    assert list(response.json()) == ["error"] and words in response.json()["error"]


async def test_unknown_api_route_is_a_404_in_ollamas_shape(client):
    response = await client.get("/api/nothing")
    assert (response.status_code, list(response.json())) == (404, ["error"])


async def test_error_after_the_stream_began_is_an_error_line(client, node):
    from shared.wire import ErrorEvent

    node.script = lambda entry: [
        delta("Hel"),
        ErrorEvent(code="node_lost", message="the node went away"),
    ]
    *_, last = lines((await client.post("/api/chat", json=ASK)).text)
    assert last == {"error": "the node went away"}


async def test_tags_show_and_ps(client, redis):
    listed = (await client.get("/api/tags")).json()["models"]
    assert [m["name"] for m in listed] == [
        f"{MODEL}:latest",
        "default:latest",
        f"{DEFAULT_EMBEDDING_MODEL_ID}:latest",
        "default-embedding:latest",
    ]
    assert listed[0]["digest"] == listed[1]["digest"] and listed[0]["details"]["format"] == "gguf"
    assert (await client.get("/api/ps")).json() == {"models": []}
    await beat(redis, "n1", {MODEL: ModelState.READY}, max_model_len=2048)
    shown = (await client.post("/api/show", json={"model": "default"})).json()
    assert shown["capabilities"] == ["completion", "tools"]
    arch = shown["model_info"]["general.architecture"]
    assert shown["model_info"][f"{arch}.context_length"] == 2048
    assert shown["model_info"]["general.basename"] == MODEL
    assert (
        await client.post("/api/show", json={"name": MODEL})
    ).json() == shown  # older clients' field
    embedder = (await client.post("/api/show", json={"model": "default-embedding"})).json()
    assert embedder["capabilities"] == ["embedding"]
    [loaded] = (await client.get("/api/ps")).json()["models"]
    assert (loaded["model"], loaded["context_length"], loaded["nodes"]) == (
        f"{MODEL}:latest",
        2048,
        ["n1"],
    )


async def test_pull_of_a_catalogued_model_succeeds_at_once(client):
    streamed = await client.post("/api/pull", json={"model": "default"})
    assert lines(streamed.text) == [{"status": "success"}]
    assert (await client.post("/api/pull", json={"model": MODEL, "stream": False})).json() == {
        "status": "success"
    }


async def test_version_needs_no_key_where_other_routes_do(settings, redis_factory):
    app = create_app(
        settings.model_copy(update={"require_api_keys": True}), redis_factory=redis_factory
    )
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway"
        ) as client,
    ):
        assert (await client.get("/api/tags")).status_code == 401
        version = (await client.get("/api/version")).json()["version"]
    assert tuple(map(int, version.split("."))) >= (
        0,
        6,
        4,
    )  # VS Code's Copilot Chat refuses older servers


async def test_delete_takes_the_admin_key_and_unloads(client, redis):
    await beat(redis, "n1", {MODEL: ModelState.READY})
    refused = await client.request("DELETE", "/api/delete", json={"model": MODEL})
    assert refused.status_code == 401 and "admin key" in refused.json()["error"]
    done = await client.request(
        "DELETE",
        "/api/delete",
        json={"model": "default:latest"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert done.status_code == 200
    [(_, [(_, fields)])] = await redis.xread({KEYS.cmd("n1"): "0"})
    assert (fields[b"cmd"], fields[b"model"]) == (b"unload", DEFAULT_MODEL_ID.encode())
    missing = await client.request(
        "DELETE",
        "/api/delete",
        json={"model": "nope"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert missing.status_code == 404


def test_latest_tag_resolves_to_the_name(app):
    catalog = app.state.ctx.catalog
    assert catalog.resolve("default:latest").id == catalog.resolve(MODEL + ":latest").id == MODEL
    with pytest.raises(ModelNotFound):
        catalog.resolve("default:7b")


async def test_a_queued_stream_carries_only_json_lines(client, redis):
    """While the job waits in the queue the response has begun (its place in a header), with no
    SSE comment among its lines: Ollama's clients parse every line as JSON."""
    await beat(redis)
    scripted = ScriptedNode(redis)

    async def serve_later() -> None:
        await asyncio.sleep(0.5)
        await scripted.run(KEYS.jobs(MODEL))

    serving = asyncio.create_task(serve_later())
    try:
        response = await client.post("/api/chat", json=ASK)
    finally:
        for task in [serving, *scripted.tasks]:
            task.cancel()
        await asyncio.gather(serving, *scripted.tasks, return_exceptions=True)
    assert int(response.headers["x-cortex-queue-position"]) > 0
    assert "".join(p["message"]["content"] for p in lines(response.text)) == "Hello!"
