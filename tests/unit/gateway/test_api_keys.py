"""API keys on one gateway (fakeredis, a scripted node): auth modes, each dialect's 401/403/404/429,
limits from real usage, the admin API, ownership of files and batches, metrics."""

import asyncio
import contextlib
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.batch import runner
from gateway.batch.runner import BatchRunner
from shared import usage_meter
from shared.api_keys import KeySpec, hash_secret, utc_day
from shared.errors import RateLimited, TokensRateLimited
from shared.settings import BatchSettings, GatewaySettings
from shared.wire import ErrorEvent, Usage
from tests.conftest import eventually
from tests.unit.gateway.conftest import KEYS, MODEL, ScriptedNode

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


async def test_a_secret_found_once_costs_one_round_trip_and_never_names_another_key(
    app, client, node, new_key, redis
):
    """The gateway keeps the name a secret maps to (keys are never deleted): later requests read only
    the key's record and its day's tokens. A key made again under that name (Redis lost its data)
    does not let the old secret in."""
    secret = await new_key("kept")
    await new_key("other")  # keys exist: auth is on whatever happens to "kept"
    assert (
        await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    ).status_code == 200
    await redis.hdel(KEYS.api_keys(), hash_secret(secret))  # found from what the gateway kept
    assert (
        await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    ).status_code == 200
    await redis.delete(KEYS.api_key("kept"))  # Redis lost it; the name is made again, a new secret
    again = await new_key("kept")
    refused = await client.post("/v1/chat/completions", json=CHAT, headers=bearer(secret))
    assert refused.status_code == 401, refused.text
    assert (
        await client.post("/v1/chat/completions", json=CHAT, headers=bearer(again))
    ).status_code == 200


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


def chat_lines(count: int) -> bytes:
    line = {"method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    return b"".join(
        json.dumps(line | {"custom_id": f"line-{i}"}).encode() + b"\n" for i in range(count)
    )


@contextlib.asynccontextmanager
async def paused_batch(app, client, new_key, redis, monkeypatch, lines: int = 3):
    """A batch of `lines` chat lines whose key (daily budget 8 tokens, rpm 1) spent its day, run by
    a `BatchRunner`, with a scripted node on the batch stream; yields (headers, batch id, runner
    task, the node, the day's counter)."""
    monkeypatch.setattr(runner, "BUDGET_RECHECK_S", 0.2)
    batch_lines = ScriptedNode(redis)
    reading = asyncio.create_task(batch_lines.run(KEYS.jobs(MODEL, "batch")))
    headers = bearer(await new_key(max_tokens_per_day=8, rpm=1))  # rpm: lines are not requests
    body = {
        "input_file_id": await upload(client, headers, chat_lines(lines)),
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    batch_id = (await client.post("/v1/batches", json=body, headers=headers)).json()["id"]
    spent = KEYS.daily_tokens("alice", utc_day())
    await redis.set(spent, 8)
    running = asyncio.create_task(
        BatchRunner(app.state.ctx, BatchSettings(redis_url="redis://fake"), batch_id).run()
    )
    try:
        await asyncio.sleep(1.5)
        paused = (await client.get(f"/v1/batches/{batch_id}", headers=headers)).json()
        assert paused["status"] == "in_progress" and batch_lines.entries == []
        assert (paused["request_counts"]["completed"], paused["request_counts"]["failed"]) == (0, 0)
        yield headers, batch_id, running, batch_lines, spent
    finally:
        for task in (running, reading):
            task.cancel()
        await asyncio.gather(running, reading, return_exceptions=True)


async def test_a_batch_over_its_keys_daily_budget_pauses_until_the_budget_resets(
    app, client, node, new_key, redis, monkeypatch
):
    """Its lines are admitted as requests are: none runs while the key's day is spent, none fails
    for it; once the budget is back (here: the day's counter gone, as at 00:00 UTC) they run."""
    async with paused_batch(app, client, new_key, redis, monkeypatch) as paused:
        headers, batch_id, running, batch_lines, spent = paused
        for ran in range(1, 4):  # each reset buys one line (8 tokens), run alone, then a pause
            await redis.delete(spent)
            await eventually(lambda: len(batch_lines.entries) == ran, 10)
            await asyncio.sleep(0.5)  # the next line waits for the next reset
            assert len(batch_lines.entries) == ran
        await asyncio.wait_for(running, 10)
    done = (await client.get(f"/v1/batches/{batch_id}", headers=headers)).json()
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 3, done
    key = await app.state.ctx.api_keys.get("alice")
    assert key.tokens_today == 8  # the last day's one line: never two lines on one day's budget


async def test_a_batch_keeps_no_more_lines_in_flight_than_its_keys_budget_left_pays_for(
    app, client, node, new_key, redis, monkeypatch
):
    """A 20-line batch (8 tokens a line) of a key with 40 tokens a day: one line first, then as many
    as the budget left pays for; it pauses having spent at most a line past the budget."""
    monkeypatch.setattr(runner, "BUDGET_RECHECK_S", 0.2)
    batch_lines = ScriptedNode(redis)
    reading = asyncio.create_task(batch_lines.run(KEYS.jobs(MODEL, "batch")))
    headers = bearer(await new_key(max_tokens_per_day=40))
    body = {
        "input_file_id": await upload(client, headers, chat_lines(20)),
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    batch_id = (await client.post("/v1/batches", json=body, headers=headers)).json()["id"]
    running = asyncio.create_task(
        BatchRunner(app.state.ctx, BatchSettings(redis_url="redis://fake"), batch_id).run()
    )
    try:
        await eventually(lambda: len(batch_lines.entries) >= 5, 10)
        await asyncio.sleep(1.0)  # paused: no more lines come
        state = (await client.get(f"/v1/batches/{batch_id}", headers=headers)).json()
        key = await app.state.ctx.api_keys.get("alice")
        assert 40 <= key.tokens_today <= 48, key.tokens_today
        assert state["status"] == "in_progress" and state["request_counts"]["failed"] == 0
        assert len(batch_lines.entries) == state["request_counts"]["completed"] <= 6
    finally:
        for task in (running, reading):
            task.cancel()
        await asyncio.gather(running, reading, return_exceptions=True)


async def test_a_batch_cancelled_while_paused_puts_its_waiting_line_in_the_error_file(
    app, client, node, new_key, redis, monkeypatch
):
    async with paused_batch(app, client, new_key, redis, monkeypatch) as paused:
        headers, batch_id, running, batch_lines, _ = paused
        await client.post(f"/v1/batches/{batch_id}/cancel", headers=headers)
        await asyncio.wait_for(running, 10)
    done = (await client.get(f"/v1/batches/{batch_id}", headers=headers)).json()
    assert done["status"] == "cancelled" and batch_lines.entries == [], done
    errors = (await client.get(f"/v1/files/{done['error_file_id']}/content", headers=headers)).text
    responses = [json.loads(line)["response"] for line in errors.splitlines()]
    # the one line that waited for the budget (a budgeted batch starts one line until one has
    # ended); the two never started are in neither file, as with OpenAI's cancelled batches
    assert [r["status_code"] for r in responses] == [429]
    assert {r["body"]["error"]["code"] for r in responses} == {"daily_budget_exceeded"}
    assert done["request_counts"]["total"] == 3


async def test_a_batch_line_counts_against_tpm_but_not_rpm(app, new_key):
    limiter, _ = app.state.ctx.limiter, await new_key(rpm=1, tpm=10)
    key = await app.state.ctx.api_keys.get("alice")
    for _ in range(3):
        await limiter.admit(key, "batch")
    await limiter.admit(key)  # the key's one interactive request this minute
    with pytest.raises(RateLimited):
        await limiter.admit(key)
    pipe = app.state.ctx.redis.pipeline(transaction=False)
    usage_meter.charge(pipe, KEYS, "alice", "job-1", Usage(prompt_tokens=10), 600)
    await pipe.execute()
    with pytest.raises(TokensRateLimited):
        await limiter.admit(key, "batch")


async def test_load_only_ollama_requests_pass_admission(client, node, new_key):
    """A chat with no messages (a generate with no prompt) loads the model, as Ollama does: only a
    model the key may use, and within its limits."""
    other = bearer(await new_key("other", models=["some-other-model"]))
    refused = await client.post("/api/chat", json={"model": "default"}, headers=other)
    assert refused.status_code == 404, refused.text
    limited = bearer(await new_key(rpm=1))
    assert (
        await client.post("/api/generate", json={"model": "default"}, headers=limited)
    ).status_code == 200
    again = await client.post("/api/chat", json={"model": "default"}, headers=limited)
    assert again.status_code == 429 and again.headers["retry-after"]
    assert node.entries == []


async def test_pulling_takes_the_admin_key(client, new_key):
    refused = await client.post(
        "/api/pull", json={"model": "default", "stream": False}, headers=bearer(await new_key())
    )
    assert refused.status_code == 403 and "admin key" in refused.json()["error"]
    pulled = await client.post(
        "/api/pull", json={"model": "default", "stream": False}, headers=bearer(ADMIN)
    )
    assert pulled.status_code == 200 and pulled.json() == {"status": "success"}


async def test_no_local_path_or_redis_setting_reaches_a_client(app, client, node, new_key):
    """`/api/show` names the model, not where its files are; `/health` says ok without the admin key
    (Redis's persistence and memory are the operator's); node messages lose URLs and paths."""
    secret = bearer(await new_key())
    profile = app.state.ctx.catalog.resolve("default")
    source = profile.source
    object.__setattr__(profile, "source", "/srv/models/secret-folder")
    try:
        shown = await client.post("/api/show", json={"model": "default"}, headers=secret)
    finally:
        object.__setattr__(profile, "source", source)
    assert shown.status_code == 200 and "/srv/models" not in shown.text
    assert shown.json()["modelfile"].startswith(f"FROM {MODEL}\n")
    for headers in ({}, secret):
        anonymous = await client.get("/health", headers=headers)
        assert anonymous.json() == {"status": "ok"}, anonymous.text
    assert "redis" in (await client.get("/health", headers=bearer(ADMIN))).json()
    node.script = lambda entry: [
        ErrorEvent(
            code="generation_failed",
            message="could not read /srv/models/secret-folder/a.bin from http://10.1.2.3:31314/x",
        )
    ]
    failed = await client.post("/v1/chat/completions", json=CHAT, headers=secret)
    message = failed.json()["error"]["message"]
    assert "10.1.2.3" not in message and "/srv/models" not in message and "<url>" in message
