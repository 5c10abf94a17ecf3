"""Every Ollama route (`/api/*`, each method the OpenAPI document lists) against oversized and
hostile bodies: a 4xx in Ollama's shape (`{"error": "..."}`) or an answer, never a 5xx, and never a
dropped pub/sub link: the gateway's and the node's subscriber connections are the same ones (same
Redis client ids) after the flood, and a bystander's streamed chat running through it completes.
A real gateway, redis-server and node agent (tiny random model), shared with the module."""

import json
import threading

import httpx
import pytest
import redis

from gateway.http.server import create_app
from shared.settings import GatewaySettings
from tests.integration.isolation.conftest import MAX_REQUEST_BYTES, MODEL
from tests.stack import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

ROUTES = sorted(
    (method.upper(), path)
    for path, operations in create_app(GatewaySettings()).openapi()["paths"].items()
    if path.startswith("/api/")
    for method in operations
)
MANY = 150_000  # items of a list in a body under the size limit (~1 MB)
HOSTILE: dict[str, bytes] = {
    "oversized": b'{"model": "' + b"a" * (MAX_REQUEST_BYTES + 1) + b'"}',
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
    "not JSON": b"\xff\xfe{model",
    "a JSON string": b'"model"',
    "null": b"null",
    "wrong types": json.dumps(
        {"model": [MODEL], "messages": "hi", "prompt": {"x": 1}, "input": 7, "stream": "yes"}
    ).encode(),
    "huge numbers": json.dumps(
        {
            "model": MODEL,
            "prompt": "hi",
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 10**30, "num_ctx": -(10**30), "temperature": 1e308},
            "keep_alive": 10**40,
            "dimensions": 10**30,
        }
    ).encode(),
    "path in the model's name": json.dumps(
        {"model": "hf:org/name@main/../../../etc", "name": "../../etc/passwd"}
    ).encode(),
    "a lone surrogate": b'{"model": "\\ud800", "prompt": "\\udfff", "input": ["\\ud800"]}',
    "many inputs": json.dumps({"model": MODEL, "input": ["a"] * MANY}).encode(),
    "many messages": json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a"}] * (MANY // 30),
            "options": {"num_predict": 2},
            "stream": False,
        }
    ).encode(),
    "a long prompt": json.dumps(
        {
            "model": MODEL,
            "prompt": "a " * MANY,
            "stream": False,
            "options": {"num_predict": 2},
        }
    ).encode(),
    "bad images": json.dumps(
        {"model": MODEL, "prompt": "hi", "images": ["not base64!", "A" * 1000], "stream": False}
    ).encode(),
}


def pubsub_ids(r: redis.Redis) -> set[str]:
    return {client["id"] for client in r.client_list(_type="pubsub")}


def bystander(url: str, outcome: dict) -> None:
    """A streamed chat, as a user beside the flood would run it."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "options": {"num_predict": 400, "temperature": 0},
    }
    with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=120) as response:
        outcome["status"] = response.status_code
        outcome["lines"] = [json.loads(line) for line in response.iter_lines() if line]


def links_while_streaming(r: redis.Redis, url: str) -> tuple[set[str], threading.Thread, dict]:
    """The pub/sub connections while a bystander streams (the gateway's event link is subscribed
    then), and the bystander's thread and outcome."""
    outcome: dict = {}
    watching = threading.Thread(target=bystander, args=(url, outcome))
    watching.start()
    wait_for(lambda: "status" in outcome, 60, "the bystander's stream")
    return pubsub_ids(r), watching, outcome


def test_every_ollama_route_refuses_hostile_bodies_with_a_4xx_and_keeps_the_links(stack):
    r = redis.Redis.from_url(stack.redis_url)
    links, watching, outcome = links_while_streaming(r, stack.gateway_url)
    assert len(links) >= 2  # the gateway's event link (subscribed while it has jobs), the node's
    answers = {}
    with httpx.Client(base_url=stack.gateway_url, timeout=120) as client:
        for method, path in ROUTES:
            for name, body in HOSTILE.items():
                response = client.request(
                    method, path, content=body, headers={"content-type": "application/json"}
                )
                answers[(method, path, name)] = response.status_code
                assert response.status_code < 500, (method, path, name, response.text[:300])
                if response.status_code >= 400:
                    error = response.json()
                    assert isinstance(error["error"], str) and error["error"], error
    watching.join(120)
    assert outcome["status"] == 200 and outcome["lines"][-1]["done"] is True, outcome
    assert not any("error" in line for line in outcome["lines"])
    for (method, path, name), status in answers.items():
        if name == "oversized" and method != "GET":
            assert status == 413, (method, path)
    after, watching, outcome = links_while_streaming(r, stack.gateway_url)
    assert after == links  # the same connections: no link was dropped and made again
    watching.join(120)
    assert outcome["lines"][-1]["done"] is True, outcome
    stack.assert_clean()
