"""Every error in OpenAI's shape, with the status and the field it concerns."""

import logging

import pytest
from redis import exceptions as redis_exceptions

from shared.redis_conn import broker_error
from tests.unit.gateway.conftest import MODEL, beat

URL = "/v1/chat/completions"
HELLO = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
JSON = {"content-type": "application/json"}


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_malformed_json(client):
    error = error_of(await client.post(URL, content=b'{"model": ', headers=JSON), 400)
    assert error["message"].startswith("invalid JSON") and error["type"] == "invalid_request_error"


async def test_missing_messages_names_the_field(client):
    error = error_of(await client.post(URL, json={"model": "default"}), 400)
    assert (error["message"], error["param"], error["code"]) == (
        "messages: Field required",
        "messages",
        "invalid_request",
    )


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": 5}, "temperature"),
        ({"n": 0}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
async def test_invalid_fields(client, fields, param):
    error = error_of(await client.post(URL, json=HELLO | fields), 400)
    assert error["param"] == param and param in error["message"]


async def test_unknown_fields_are_ignored_and_logged_once(client, node, caplog):
    """A newer client's field is no reason to refuse it; a known field with a wrong type still is."""
    caplog.set_level(logging.INFO, logger="gateway.dialects.protocol.lenient")
    body = HELLO | {
        "x_future_option": {"a": 1},
        "messages": [{"role": "user", "content": "hi", "x_future_message_field": 1}],
    }
    for _ in range(2):
        assert (await client.post(URL, json=body)).status_code == 200
    logged = [r.getMessage() for r in caplog.records if "x_future" in r.getMessage()]
    assert sorted(logged) == [
        "ignoring unknown field ChatCompletionRequest.x_future_option (logged once)",
        "ignoring unknown field ChatCompletionRequestUserMessage.x_future_message_field (logged once)",
    ]
    error = error_of(await client.post(URL, json=HELLO | {"parallel_tool_calls": "sometimes"}), 400)
    assert error["param"] == "parallel_tool_calls"


async def test_body_not_an_object(client):
    for content, headers in (
        (b"[1, 2]", JSON),
        (b"", JSON),
        (b'{"model": "x"}', {"content-type": "text/plain"}),
    ):
        error = error_of(await client.post(URL, content=content, headers=headers), 400)
        assert "JSON object" in error["message"]


async def test_unknown_model_is_404(client):
    error = error_of(await client.post(URL, json=HELLO | {"model": "gpt-9"}), 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "gpt-9" in error["message"]


async def test_no_live_node_is_503_and_says_why(client, redis):
    error = error_of(await client.post(URL, json=HELLO), 503)
    assert error["code"] == "insufficient_capacity"
    assert error["message"].endswith("live nodes: none (no node agent has sent a recent heartbeat)")
    await beat(redis, "n-old", age_s=60)  # dead: its heartbeat is too old
    await beat(redis, "n-other", {"Other-Model": "ready"})
    error = error_of(
        await client.post("/v1/completions", json={"model": "default", "prompt": "x"}), 503
    )
    assert error["message"].startswith(f"{MODEL} needs ")
    assert "the best candidate, n-other, has 0 MB free" in error["message"]


async def test_unknown_route_and_method(client):
    error = error_of(await client.get("/v1/nothing"), 404)
    assert error["code"] == "not_found" and "/v1/nothing" in error["message"]
    error = error_of(await client.get(URL), 405)
    assert error["code"] == "method_not_allowed"


async def test_gateway_keeps_serving_after_bad_requests(client, node):
    await client.post(URL, content=b"{", headers=JSON)
    await client.post(URL, json=HELLO | {"temperature": 5})
    response = await client.post(URL, json=HELLO)
    assert (
        response.status_code == 200
        and response.json()["choices"][0]["message"]["content"] == "Hello!"
    )


@pytest.mark.parametrize(
    "method, url, body, status, reason",
    [
        ("POST", URL, {"model": "default"}, 400, "messages: Field required"),
        ("POST", URL, HELLO | {"model": "nope"}, 404, "The model 'nope' does not exist."),
        ("GET", "/v1/nowhere", None, 404, "Not Found: GET /v1/nowhere"),
        (
            "POST",
            "/v1/messages",
            {"model": "default", "max_tokens": 1},
            400,
            "messages: Field required",
        ),
        (
            "POST",
            "/v1/responses",
            {"model": "default", "input": [{"id": "msg_1"}]},
            400,
            "items are not kept by id",
        ),
    ],
)
async def test_every_4xx_is_logged_once_at_info_with_its_request_id_and_reason(
    client, caplog, method, url, body, status, reason
):
    caplog.set_level(logging.INFO, logger="gateway")
    response = await client.request(method, url, json=body, headers={"x-request-id": "req-4xx"})
    assert response.status_code == status
    lines = [r for r in caplog.records if "request=req-4xx " in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert (
        lines[0].levelno == logging.INFO and f"{method} {url} → {status}" in lines[0].getMessage()
    )
    assert reason in lines[0].getMessage()


@pytest.mark.parametrize(
    "exc, code, says",
    [
        (
            redis_exceptions.OutOfMemoryError(
                "command not allowed when used memory > 'maxmemory'."
            ),
            "redis_out_of_memory",
            "out of memory",
        ),
        (
            redis_exceptions.ReadOnlyError("You can't write against a read only replica."),
            "redis_read_only",
            "read-only replica",
        ),
        (
            redis_exceptions.ResponseError(
                "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to "
                "persist to disk."
            ),
            "redis_cannot_persist",
            "cannot save to disk",
        ),
        (
            redis_exceptions.ConnectionError(
                "Error 111 connecting to 127.0.0.1:6379. Connection refused."
            ),
            "broker_unavailable",
            "Redis is unavailable: Error 111",
        ),
    ],
)
def test_redis_refusing_is_a_503_naming_the_cause(exc, code, says):
    error = broker_error(exc, "could not enqueue the job")
    assert (error.status, error.code) == (503, code)
    assert error.message.startswith("could not enqueue the job: ") and says in error.message
