"""API keys end to end with the official openai and anthropic SDKs: two gateway replicas sharing one
Redis, a real node agent (tiny random model) and batch worker, keys made with the `cortex keys` CLI."""

import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.batch.conftest import MODEL, chat_line, jsonl
from tests.integration.batch.test_batches import output_lines, wait_status
from tests.integration.keys.conftest import ADMIN_KEY, cortex_keys, create_key, show_key

pytestmark = pytest.mark.integration

HI = [{"role": "user", "content": "Tell me a story."}]
FIXED = {
    "max_tokens": 5,
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}  # always 5 completion tokens


def openai_client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def anthropic_client(url: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, **extra):
    return client.chat.completions.create(model=MODEL, messages=HI, **(FIXED | extra))


def test_sdks_raise_their_authentication_errors(keys_stack):
    url = keys_stack.replicas[0]
    valid = create_key(keys_stack, "valid")
    revoked = create_key(keys_stack, "to-revoke")
    assert cortex_keys(keys_stack, "revoke", "to-revoke").returncode == 0
    expired = create_key(keys_stack, "short-lived", "--expires", "1s")
    time.sleep(1.2)
    for key in (None, "sk-cortex-wrong", revoked, expired):  # None: no key header at all
        with pytest.raises(openai.AuthenticationError) as caught:
            chat(
                openai_client(url, key or "x"),
                extra_headers={"Authorization": openai.Omit()} if key is None else {},
            )
        assert caught.value.code == "invalid_api_key"
        with pytest.raises(anthropic.AuthenticationError):
            anthropic_client(url, key or "x").messages.create(
                model=MODEL,
                max_tokens=4,
                messages=HI,
                extra_headers={"X-Api-Key": anthropic.Omit()} if key is None else {},
            )
    assert "is revoked" in str(
        pytest.raises(openai.AuthenticationError, chat, openai_client(url, revoked)).value
    )

    client = openai_client(url, valid)
    assert chat(client).usage.completion_tokens == 5
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5
    messages = anthropic_client(url, valid)
    assert messages.messages.create(model=MODEL, max_tokens=4, messages=HI).usage.output_tokens >= 1
    with messages.messages.stream(model=MODEL, max_tokens=4, messages=HI) as stream:
        assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")
    keys_stack.assert_clean()


def test_rpm_is_shared_by_two_replicas(keys_stack):
    created = httpx.post(
        f"{keys_stack.replicas[0]}/admin/keys",
        json={"name": "rpm10", "rpm": 10},
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert created.status_code == 200, created.text
    clients = [openai_client(url, created.json()["secret"]) for url in keys_stack.replicas]

    def attempt(i: int):
        try:
            return chat(clients[i % 2], max_tokens=1)
        except openai.RateLimitError as exc:
            return exc

    with ThreadPoolExecutor(30) as pool:
        results = list(pool.map(attempt, range(30)))
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 20 and len(results) - len(refused) == 10, results
    for exc in refused:
        assert 1 <= int(exc.response.headers["retry-after"]) <= 60
        assert exc.code == "rate_limit_exceeded" and "rpm" in exc.message
    usage = show_key(keys_stack, "rpm10")
    assert (usage["requests"], usage["rejections"]) == (10, 20)
    admitted = sum(
        _metric(url, "cortex:key_requests_total", key="rpm10") for url in keys_stack.replicas
    )
    assert admitted == 10
    keys_stack.assert_clean()


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def test_tpm_and_daily_budgets_count_real_tokens(keys_stack):
    url = keys_stack.replicas[1]
    first = chat(openai_client(url, create_key(keys_stack, "meter"))).usage
    tokens = first.prompt_tokens + first.completion_tokens
    usage = show_key(keys_stack, "meter")
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["tokens_today"]) == (
        first.prompt_tokens,
        first.completion_tokens,
        tokens,
    )

    per_minute = openai_client(url, create_key(keys_stack, "tpm", "--tpm", str(tokens + 1)))
    chat(per_minute)  # 0 tokens in the last minute
    chat(per_minute)  # `tokens`, still below the limit; afterwards 2 × tokens
    with pytest.raises(openai.RateLimitError) as caught:
        chat(per_minute)
    assert "tpm" in caught.value.message and int(caught.value.response.headers["retry-after"]) <= 60

    daily = create_key(keys_stack, "daily", "--max-tokens-per-day", str(tokens))
    chat(openai_client(url, daily))
    with pytest.raises(openai.RateLimitError) as caught:
        chat(openai_client(url, daily))
    assert caught.value.code == "daily_budget_exceeded"
    assert (
        abs(int(caught.value.response.headers["retry-after"]) - (86400 - time.time() % 86400)) <= 5
    )
    with pytest.raises(anthropic.RateLimitError):
        anthropic_client(url, daily).messages.create(model=MODEL, max_tokens=4, messages=HI)
    assert show_key(keys_stack, "daily")["rejections"] == 2
    keys_stack.assert_clean()


def test_a_client_that_leaves_is_charged_what_its_job_used(keys_stack):
    name = "leaver"
    stream = openai_client(
        keys_stack.replicas[0], create_key(keys_stack, name)
    ).chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 3:
            break
    stream.close()  # the gateway cancels the job; the node ends it and counts what it used
    deadline = time.monotonic() + 30
    while (usage := show_key(keys_stack, name))[
        "completion_tokens"
    ] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert usage["prompt_tokens"] > 0 and 3 <= usage["completion_tokens"] <= 400, usage
    assert usage["tokens_today"] == usage["prompt_tokens"] + usage["completion_tokens"]
    keys_stack.assert_clean()


def test_files_and_batches_belong_to_their_key(keys_stack):
    url = keys_stack.replicas[0]
    a, b = (
        openai_client(url, create_key(keys_stack, "owner-a")),
        openai_client(url, create_key(keys_stack, "owner-b")),
    )
    admin = openai_client(url, ADMIN_KEY)
    secret_line = chat_line("secret", "SECRET-CUSTOMER-DATA", max_tokens=3)
    uploaded = a.files.create(
        file=("in.jsonl", jsonl([secret_line, chat_line("two", "hello", max_tokens=3)])),
        purpose="batch",
    )
    assert uploaded.id not in [f.id for f in b.files.list()]
    for attempt in (
        lambda: b.files.retrieve(uploaded.id),
        lambda: b.files.content(uploaded.id),
        lambda: b.files.delete(uploaded.id),
        lambda: b.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    batch = a.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_status(a, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.request_counts.completed == 2
    assert {line["custom_id"] for line in output_lines(a, done.output_file_id)} == {"secret", "two"}
    for attempt in (
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.files.content(done.output_file_id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert b.batches.list().data == [] and b.files.list().data == []
    assert {uploaded.id, done.output_file_id} <= {f.id for f in admin.files.list()}
    assert b"SECRET-CUSTOMER-DATA" in admin.files.content(uploaded.id).content
    assert batch.id in [x.id for x in admin.batches.list()]
    assert (
        show_key(keys_stack, "owner-a")["completion_tokens"] >= 2
    )  # the batch's lines count as the key's
    keys_stack.assert_clean()


def test_cli_lists_keys_without_secrets_and_logs_name_keys_only(keys_stack):
    secret = create_key(keys_stack, "listed", "--models", MODEL, "--rpm", "7")
    again = cortex_keys(keys_stack, "create", "--name", "listed")
    assert again.returncode == 2 and "exists already" in again.stderr
    bad = cortex_keys(keys_stack, "create", "--name", "no spaces")
    assert bad.returncode == 2 and "name" in bad.stderr
    listed = cortex_keys(keys_stack, "list")
    assert listed.returncode == 0 and "listed" in listed.stdout and secret not in listed.stdout
    assert secret[:14] in listed.stdout  # the hint that tells keys apart
    chat(openai_client(keys_stack.replicas[0], secret))
    logs = "".join(
        s.log_path.read_text(errors="replace") for s in keys_stack.services if s.name == "gateway"
    )
    assert "key=listed" in logs and secret not in logs
    client = keys_stack.client()
    assert not any(secret.encode() in key for key in client.keys("*"))
