"""Every body a client can send to a POST route gets a 4xx in its dialect's shape, or is served:
never a 5xx. Hypothesis draws bodies from the pydantic schemas of the routes' request models (as the
gateway's OpenAPI document carries them), some following the schema, some with any value replaced
by any JSON value (strings with unpaired surrogates, integers past 64 bits, wrong types, deep
nesting), plus raw bytes, against a real gateway, redis-server and node agent (tiny random model).
CI draws `EXAMPLES` per route; `CORTEX_FUZZ_EXAMPLES=N` draws more."""

import json
import os
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.http.server import create_app
from shared.settings import GatewaySettings
from tests.integration.fleet.conftest import catalogue
from tests.json_schema_bodies import TEXT, Bodies, nested
from tests.stack import Stack, serving

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

MODEL = "tiny-fuzz"
ADMIN_KEY = (
    "fuzz-admin-key"  # every request carries it: keys the fuzzer creates must not lock it out
)
EXAMPLES = int(os.environ.get("CORTEX_FUZZ_EXAMPLES", "20"))
REQUEST_TIMEOUT_S = 60
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# POSTs that act on the fleet rather than take a body: a drawn `unload` or `drain` would take the node away
FLEET_ACTIONS = ("/admin/models/", "/admin/nodes/")

DOCUMENT = create_app(GatewaySettings()).openapi()
BODIES = Bodies(DOCUMENT["components"]["schemas"])
JSON_ROUTES = {
    path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]
    for path, ops in DOCUMENT["paths"].items()
    if "application/json" in ops.get("post", {}).get("requestBody", {}).get("content", {})
}
ID_ROUTES = [
    path
    for path, ops in DOCUMENT["paths"].items()
    if "post" in ops
    and "{" in path
    and "requestBody" not in ops["post"]
    and not path.startswith(FLEET_ACTIONS)
]
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_dirs) -> Iterator[Stack]:
    toml = catalogue(tiny_dirs["llama"], **{MODEL: {"slots": 8}})
    with serving(
        tmp_path_factory.mktemp("fuzz"), toml, "n1", [MODEL], CORTEX_ADMIN_KEY=ADMIN_KEY
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=stack.gateway_url,
        timeout=REQUEST_TIMEOUT_S,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ) as client:
        yield client


def _small(body) -> None:
    """The served model, and little work for each request that would be served."""
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = MODEL
    for name in TOKEN_FIELDS:
        if isinstance(body.get(name), int):
            body[name] = min(max(body[name], 1), 4)
    if isinstance(body.get("n"), int):
        body["n"] = min(body["n"], 2)
    body.pop("best_of", None)


def check(response: httpx.Response, path: str) -> None:
    """Served, or a 4xx in the dialect's error shape."""
    assert response.status_code < 500, f"{path} → {response.status_code} {response.text[:500]}"
    if response.status_code < 400:
        return
    error = response.json()
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] and error["error"]["message"], (
            error
        )
    elif path.startswith("/api/"):  # Ollama's shape: {"error": "..."}
        assert isinstance(error["error"], str) and error["error"], error
    else:
        assert error["error"]["message"], error


def post_json(client: httpx.Client, path: str, body) -> httpx.Response:
    """`body` as JSON text the way an ASCII-only encoder writes it (a lone surrogate as `\\udXXX`)."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", sorted(JSON_ROUTES))
@FUZZ
@given(data=st.data())
def test_bodies_drawn_from_the_schema_get_a_4xx_or_an_answer(client, path, data):
    body = data.draw(BODIES.of(JSON_ROUTES[path]) | BODIES.of(JSON_ROUTES[path], junk=True))
    _small(body)
    check(post_json(client, path, body), path)


@pytest.mark.parametrize("path", sorted(JSON_ROUTES))
@FUZZ
@given(raw=st.binary(max_size=64) | st.binary(max_size=32).map(lambda tail: b'{"model": "' + tail))
def test_raw_bytes_get_a_4xx(client, path, raw):
    check(client.post(path, content=raw, headers={"content-type": "application/json"}), path)


@pytest.mark.parametrize("path", sorted(ID_ROUTES))
@FUZZ
@given(given_id=TEXT.filter(bool))
def test_any_id_gets_a_4xx_or_an_answer(client, path, given_id):
    name = path[path.index("{") + 1 : path.index("}")]
    concrete = path.replace(
        "{" + name + "}", quote(given_id.encode("utf-8", "surrogatepass"), safe="")
    )
    check(client.post(concrete), path)


@FUZZ
@given(purpose=TEXT, content=st.binary(max_size=64), filename=TEXT)
def test_uploads_get_a_4xx_or_an_answer(client, purpose, content, filename):
    files = {
        "file": (filename.encode("utf-8", "surrogatepass").decode("utf-8", "replace"), content)
    }
    check(
        client.post(
            "/v1/files",
            data={"purpose": purpose.encode("utf-8", "surrogatepass").decode("utf-8", "replace")},
            files=files,
        ),
        "/v1/files",
    )


LONE = "\ud800"
SURROGATE_BODIES = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": LONE}],
        "max_tokens": 4,
    },
    "/v1/completions": {"model": MODEL, "prompt": LONE, "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": LONE, "max_output_tokens": 4},
    "/v1/messages": {
        "model": MODEL,
        "messages": [{"role": "user", "content": LONE}],
        "max_tokens": 4,
    },
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": LONE}]},
}


@pytest.mark.parametrize("path", sorted(SURROGATE_BODIES))
def test_an_unpaired_surrogate_is_a_400_and_a_pair_is_served(client, path):
    refused = post_json(client, path, SURROGATE_BODIES[path])
    assert refused.status_code == 400, refused.text
    check(refused, path)
    assert "unpaired" in refused.text
    paired = post_json(
        client,
        path,
        json.loads(json.dumps(SURROGATE_BODIES[path]).replace("\\ud800", "\\ud83d\\ude00")),
    )
    assert paired.status_code == 200, paired.text


DEEP = 400  # levels of free-form JSON: past what pydantic's serializer (~250) and a chat template's renderer take
DEEP_BODIES = {
    "chat_template_kwargs": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "chat_template_kwargs": {"deep": nested(DEEP)},
        },
    ),
    "tool parameters": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "x": nested(DEEP)}},
                }
            ],
        },
    ),
    "container": (
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}],
            "container": nested(DEEP),
        },
    ),
    "input_schema": (
        "/v1/messages/count_tokens",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"name": "f", "input_schema": nested(DEEP)}],
        },
    ),
    "response text format": (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "Hi",
            "max_output_tokens": 2,
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "s",
                    "schema": {"type": "object", "x": nested(DEEP)},
                }
            },
        },
    ),
}


@pytest.mark.parametrize("name", sorted(DEEP_BODIES))
def test_deeply_nested_free_form_json_is_a_400(client, name):
    path, body = DEEP_BODIES[name]
    refused = post_json(client, path, body)
    check(refused, path)
    assert refused.status_code == 400 and "nested more than" in refused.text
