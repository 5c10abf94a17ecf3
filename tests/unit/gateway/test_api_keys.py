"""API keys on one gateway (fakeredis, a scripted node): auth modes, each dialect's 401/403/404/429,
limits from real usage, the admin API, ownership of files and batches, metrics."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.api_keys import KeySpec
from shared.settings import GatewaySettings
from tests.unit.gateway.conftest import KEYS, MODEL

ADMIN = "admin-secret"
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MESSAGE = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def settings() -> GatewaySettings:
    return GatewaySettings(redis_url="redis://fake", request_timeout_s=5.0, admin_key=ADMIN)


@pytest.fixture
def new_key(app):
    async def create(name: str = "alice", **spec) -> str:
        _, secret = await app.state.ctx.api_keys.create(KeySpec(name=name, **spec))
        return secret

    return create


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


async def test_auth_is_off_on_loopback_while_no_key_exists(client, node):
    for headers in ({}, bearer("unused"), {"x-api-key": "anything"}):
        assert (
            await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        ).status_code == 200


@pytest.mark.parametrize("overrides", [{"host": "0.0.0.0"}, {"require_api_keys": True}])
async def test_auth_is_on_beyond_loopback_or_when_required(redis_factory, node, overrides):
    import httpx

    from gateway.http.server import create_app

    app = create_app(
        GatewaySettings(redis_url="redis://fake", **overrides), redis_factory=redis_factory
    )
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway"
        ) as client,
    ):
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert (
        response.status_code == 401 and "cortex keys create" in response.json()["error"]["message"]
    )
    assert node.entries == []


async def test_missing_and_wrong_keys_are_401_in_each_dialect(client, node, new_key):
    await new_key()
    for headers in ({}, bearer("sk-cortex-wrong"), {"x-api-key": "sk-cortex-wrong"}):
        openai_style = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert openai_style.status_code == 401
        assert openai_style.json()["error"] | {"message": ""} == {
            "message": "",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
        anthropic_style = await client.post("/v1/messages", json=MESSAGE, headers=headers)
        assert anthropic_style.status_code == 401
        assert anthropic_style.json()["type"] == "error"
        assert anthropic_style.json()["error"]["type"] == "authentication_error"
    assert (await client.get("/v1/models")).status_code == 401
    assert (await client.get("/v1/files")).status_code == 401
    assert (await client.get("/health")).status_code == 200
    assert node.entries == []


async def test_a_valid_key_works_as_bearer_or_x_api_key(client, node, new_key):
    secret = await new_key()
    assert (
        await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    ).status_code == 200
    assert (
        await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": secret})
    ).status_code == 200


async def test_revoked_and_expired_keys_are_401(app, client, node, new_key, redis):
    revoked, expired = await new_key("gone"), await new_key("old", expires="1h")
    await app.state.ctx.api_keys.revoke("gone")
    await redis.hset(KEYS.api_key("old"), "expires_ms", str(int(time.time() * 1000) - 1))
    for secret, state in ((revoked, "revoked"), (expired, "expired")):
        response = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
        assert response.status_code == 401 and f"is {state}" in response.json()["error"]["message"]
    assert node.entries == []


async def test_a_model_the_key_may_not_use(client, node, new_key):
    secret = await new_key(models=["some-other-model"])
    openai_style = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert (
        openai_style.status_code == 404
        and openai_style.json()["error"]["code"] == "model_not_found"
    )
    anthropic_style = await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": secret})
    assert (
        anthropic_style.status_code == 403
        and anthropic_style.json()["error"]["type"] == "permission_error"
    )
    assert (await client.get("/v1/models", headers=bearer(secret))).json()["data"] == []
    allowed = await new_key("by-alias", models=["default"])  # an alias names the model too
    assert (
        await client.post("/v1/chat/completions", json=CHAT, headers=bearer(allowed))
    ).status_code == 200
    assert [
        m["id"] for m in (await client.get("/v1/models", headers=bearer(allowed))).json()["data"]
    ] == [MODEL, "default"]


async def test_rpm_is_429_with_retry_after_in_each_dialect(app, client, node, new_key):
    secret = await new_key(rpm=2)
    for _ in range(2):
        assert (
            await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
        ).status_code == 200
    refused = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
    assert (
        refused.json()["error"]["code"] == "rate_limit_exceeded"
        and "rpm" in refused.json()["error"]["message"]
    )
    anthropic_style = await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": secret})
    assert anthropic_style.status_code == 429 and anthropic_style.headers["retry-after"]
    assert anthropic_style.json()["error"]["type"] == "rate_limit_error"
    key = await app.state.ctx.api_keys.get("alice")
    assert (key.requests, key.rejections) == (2, 2)
    assert len(node.entries) == 2


async def test_tpm_counts_finished_jobs_real_tokens(app, client, node, new_key):
    secret = await new_key(tpm=10)  # the scripted node reports 5 prompt + 3 completion tokens a job
    for _ in range(2):  # 0, then 8 tokens used in the last minute: below 10
        assert (
            await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
        ).status_code == 200
    refused = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert refused.status_code == 429 and "tpm" in refused.json()["error"]["message"]
    assert refused.json()["error"]["type"] == "tokens" and int(refused.headers["retry-after"]) <= 60
    key = await app.state.ctx.api_keys.get("alice")
    assert (key.prompt_tokens, key.completion_tokens, key.tokens_today) == (10, 6, 16)


async def test_daily_budget_holds_until_the_utc_day_ends(client, node, new_key):
    secret = await new_key(max_tokens_per_day=8)
    assert (
        await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    ).status_code == 200
    refused = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "daily_budget_exceeded"
    seconds_left_today = 86400 - time.time() % 86400
    assert abs(int(refused.headers["retry-after"]) - seconds_left_today) <= 2


async def test_streamed_jobs_count_too(app, client, node, new_key):
    secret = await new_key()
    response = await client.post(
        "/v1/chat/completions", json=CHAT | {"stream": True}, headers=bearer(secret)
    )
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    key = await app.state.ctx.api_keys.get("alice")
    assert (key.requests, key.prompt_tokens, key.completion_tokens) == (1, 5, 3)


async def test_counting_tokens_is_a_request_but_uses_no_tokens(app, client, node, new_key):
    secret = await new_key(rpm=1)
    count = {"model": "default", "messages": MESSAGE["messages"]}
    assert (
        await client.post("/v1/messages/count_tokens", json=count, headers={"x-api-key": secret})
    ).status_code == 200
    key = await app.state.ctx.api_keys.get("alice")
    assert (key.requests, key.prompt_tokens, key.tokens_today) == (1, 0, 0)
    assert (
        await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": secret})
    ).status_code == 429


async def test_admin_api_takes_only_bearer_admin_key(client, new_key):
    client_key = await new_key()
    for headers in ({"authorization": ADMIN}, {"x-api-key": ADMIN}, bearer(client_key), {}):
        assert (await client.get("/admin/keys", headers=headers)).status_code == 401, headers
    assert (await client.get("/admin/keys", headers=bearer(ADMIN))).status_code == 200


async def test_admin_keys_api_and_no_secret_in_redis(client, redis):
    created = await client.post(
        "/admin/keys",
        headers=bearer(ADMIN),
        json={"name": "svc", "models": ["default"], "rpm": 5, "expires": "30d"},
    )
    assert created.status_code == 200, created.text
    body = created.json()
    secret = body.pop("secret")
    assert secret.startswith("sk-cortex-") and body["hint"] == secret[:14] and "hash" not in body
    assert body["state"] == "active" and body["rpm"] == 5 and body["models"] == ["default"]
    assert abs(body["expires_ms"] - body["created_ms"] - 30 * 86400_000) < 1000
    again = await client.post("/admin/keys", headers=bearer(ADMIN), json={"name": "svc"})
    assert again.status_code == 409
    bad = await client.post("/admin/keys", headers=bearer(ADMIN), json={"name": "admin"})
    assert bad.status_code == 400 and "reserved" in bad.json()["error"]["message"]
    listed = (await client.get("/admin/keys", headers=bearer(ADMIN))).json()["data"]
    assert [k["name"] for k in listed] == ["svc"] and "secret" not in listed[0]
    revoked = (await client.post("/admin/keys/svc/revoke", headers=bearer(ADMIN))).json()
    assert revoked["state"] == "revoked" and revoked["revoked_ms"] > 0
    assert (await client.get("/admin/keys/nobody", headers=bearer(ADMIN))).status_code == 404
    stored = [
        v
        for key in await redis.keys("*")
        if await redis.type(key) == b"hash"
        for v in (await redis.hgetall(key)).values()
    ]
    assert stored and not any(secret.encode() in v for v in stored)


async def upload(client, headers: dict, content: bytes = b'{"custom_id": "a"}\n') -> str:
    response = await client.post(
        "/v1/files",
        headers=headers,
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", content)},
    )
    assert response.status_code == 200, response.text
    return response.json()["id"]


async def test_files_and_batches_belong_to_their_key(client, new_key):
    a, b = bearer(await new_key("a")), bearer(await new_key("b"))
    file_id = await upload(client, a)
    assert [f["id"] for f in (await client.get("/v1/files", headers=b)).json()["data"]] == []
    for method, path in (
        ("GET", f"/v1/files/{file_id}"),
        ("GET", f"/v1/files/{file_id}/content"),
        ("DELETE", f"/v1/files/{file_id}"),
    ):
        assert (await client.request(method, path, headers=b)).status_code == 404, path
    batch_body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    assert (await client.post("/v1/batches", json=batch_body, headers=b)).status_code == 404
    batch = await client.post("/v1/batches", json=batch_body, headers=a)
    assert batch.status_code == 200, batch.text
    batch_id = batch.json()["id"]
    assert (await client.get(f"/v1/batches/{batch_id}", headers=b)).status_code == 404
    assert (await client.post(f"/v1/batches/{batch_id}/cancel", headers=b)).status_code == 404
    assert (await client.get("/v1/batches", headers=b)).json()["data"] == []
    for owner in (a, bearer(ADMIN)):
        assert [f["id"] for f in (await client.get("/v1/files", headers=owner)).json()["data"]] == [
            file_id
        ]
        assert (
            await client.get(f"/v1/files/{file_id}/content", headers=owner)
        ).content == b'{"custom_id": "a"}\n'
        assert [
            x["id"] for x in (await client.get("/v1/batches", headers=owner)).json()["data"]
        ] == [batch_id]
    assert (await client.delete(f"/v1/files/{file_id}", headers=bearer(ADMIN))).status_code == 200


async def test_listing_one_owners_batches_pages_past_others(app, client, new_key):
    a, b = bearer(await new_key("a")), bearer(await new_key("b"))
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    mine = [
        (
            await client.post(
                "/v1/batches", json=body | {"input_file_id": await upload(client, a)}, headers=a
            )
        ).json()["id"]
        for _ in range(3)
    ]
    for _ in range(120):  # more than one round of the listing's scan
        await client.post(
            "/v1/batches", json=body | {"input_file_id": await upload(client, b)}, headers=b
        )
    page = (await client.get("/v1/batches", params={"limit": 2}, headers=a)).json()
    assert [x["id"] for x in page["data"]] == mine[::-1][:2] and page["has_more"]
    rest = (await client.get("/v1/batches", params={"after": mine[1]}, headers=a)).json()
    assert [x["id"] for x in rest["data"]] == [mine[0]] and not rest["has_more"]


async def test_metrics_name_keys_never_secrets_and_only_to_the_admin_key(client, node, new_key):
    secret = await new_key(rpm=1)
    for _ in range(2):
        await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    for anonymous in ({}, bearer(secret)):
        assert "alice" not in (await client.get("/metrics", headers=anonymous)).text
    text = (await client.get("/metrics", headers=bearer(ADMIN))).text
    assert secret not in text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("cortex:key_requests_total", (("key", "alice"),))] == 1
    assert samples[("cortex:key_rejections_total", (("key", "alice"), ("limit", "requests")))] == 1
    assert samples[("cortex:key_prompt_tokens_total", (("key", "alice"),))] == 5
    assert samples[("cortex:key_completion_tokens_total", (("key", "alice"),))] == 3


async def test_log_lines_about_a_request_name_its_key(client, node, new_key, caplog):
    secret = await new_key()
    with caplog.at_level("INFO", logger="gateway.jobs.job"):
        await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.jobs.job"]
    assert (
        lines
        and all("key=alice" in line for line in lines)
        and not any(secret in line for line in lines)
    )
