"""Fair shares and overload end to end (one gateway, one node with two slots, a tiny random model,
API keys): a key's flood of queued requests does not starve another key's one request, counted in
jobs, not timed; a request past its queue deadline, and one finding too many waiting, get a fast
503 (Anthropic: 529) with `Retry-After` in its dialect's error shape; nothing is left behind
(stream entries, waiting rooms, pending entries, event channels)."""

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.fleet.conftest import ADMIN_KEY, catalogue
from tests.stack import Stack, start_stack

pytestmark = pytest.mark.integration

MODEL = "tiny-fair"
FLOOD = 200
LONG_TOKENS = 200  # a job that holds its slot for a while (max_model_len is 256)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_dirs) -> Iterator[Stack]:
    toml = catalogue(tiny_dirs["llama"], **{MODEL: {"slots": 2}})
    stack = start_stack(tmp_path_factory.mktemp("fair"), toml, CORTEX_ADMIN_KEY=ADMIN_KEY)
    try:
        stack.start_gateway()
        stack.start_node("n1", [MODEL])
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def secrets(stack) -> dict[str, str]:
    made = {}
    for name in ("flood", "bystander"):
        created = httpx.post(
            f"{stack.gateway_url}/admin/keys",
            json={"name": name},
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
        )
        assert created.status_code == 200, created.text
        made[name] = created.json()["secret"]
    return made


def body(max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": max_tokens,
    }


async def post(
    client: httpx.AsyncClient, secret: str, max_tokens: int, path="/v1/chat/completions", **headers
) -> httpx.Response:
    headers["authorization"] = f"Bearer {secret}"
    return await client.post(path, json=body(max_tokens), headers=headers, timeout=300)


def waiting(stack: Stack) -> int:
    """Interactive jobs of MODEL no node has read yet (`/v1/queue`)."""
    queues = httpx.get(
        f"{stack.gateway_url}/v1/queue", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    found = [q for q in queues.json()["data"] if q["model"] == MODEL]
    return found[0]["queued"]["interactive"] if found else 0


async def until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def assert_nothing_left(stack: Stack) -> None:
    stack.assert_clean(timeout_s=60)
    assert stack.client().pubsub_channels("cortex:events:*") == []


async def _flood_and_one(stack: Stack, secrets: dict[str, str]) -> tuple[int, list[int]]:
    done = 0

    async def flooding(client) -> int:
        nonlocal done
        answer = await post(client, secrets["flood"], 8)
        done += 1
        return answer.status_code

    limits = httpx.Limits(max_connections=FLOOD + 10)
    async with httpx.AsyncClient(base_url=stack.gateway_url, limits=limits) as client:
        flood = [asyncio.create_task(flooding(client)) for _ in range(FLOOD)]
        await until(lambda: waiting(stack) >= FLOOD // 2)
        before = done
        answer = await post(client, secrets["bystander"], 8)
        assert answer.status_code == 200, answer.text
        overtaken = done - before
        return overtaken, await asyncio.gather(*flood)


def test_a_flood_from_one_key_does_not_starve_another_keys_request(stack, secrets):
    overtaken, statuses = asyncio.run(_flood_and_one(stack, secrets))
    assert statuses == [200] * FLOOD
    # two running, one on the shared stream, one from the flood's room in turn, then the bystander's
    # (which runs beside one more): not the hundred or more queued before it
    assert overtaken <= 8, overtaken
    assert_nothing_left(stack)


async def _past_deadline(stack: Stack, secrets: dict[str, str]):
    async with httpx.AsyncClient(base_url=stack.gateway_url) as client:
        busy = [asyncio.create_task(post(client, secrets["flood"], LONG_TOKENS)) for _ in range(6)]
        await until(lambda: waiting(stack) >= 3)
        # the flooding key's own: it has jobs running, so its next waits in its room behind them (another
        # key's first job would start at once, beyond the slots: node_agent/serving/job_reader.py)
        started = time.monotonic()
        openai_late = await post(client, secrets["flood"], 4, **{"x-cortex-queue-timeout": "0.3"})
        took_s = time.monotonic() - started
        anthropic_late = await post(
            client, secrets["flood"], 4, "/v1/messages", **{"x-cortex-queue-timeout": "0.3"}
        )
        return openai_late, took_s, anthropic_late, await asyncio.gather(*busy)


def test_a_request_past_its_queue_deadline_is_taken_off_the_queue(stack, secrets):
    openai_late, took_s, anthropic_late, busy = asyncio.run(_past_deadline(stack, secrets))
    assert openai_late.status_code == 503, openai_late.text
    assert openai_late.headers["retry-after"] == "5" and took_s < 5
    error = openai_late.json()["error"]
    assert error["code"] == "queue_timeout" and "taken off" in error["message"]
    assert anthropic_late.status_code == 529 and anthropic_late.headers["retry-after"] == "5"
    assert anthropic_late.json()["error"]["type"] == "overloaded_error"
    assert [r.status_code for r in busy] == [200] * len(busy)
    assert_nothing_left(stack)


async def _too_many_waiting(stack: Stack, secrets: dict[str, str], shedding: str):
    async with httpx.AsyncClient(base_url=stack.gateway_url) as client:
        busy = [asyncio.create_task(post(client, secrets["flood"], LONG_TOKENS)) for _ in range(8)]
        await until(lambda: waiting(stack) >= 5)
        async with httpx.AsyncClient(base_url=shedding) as other:
            started = time.monotonic()
            refused = await post(other, secrets["bystander"], 4)
            took_s = time.monotonic() - started
            ollama = await post(other, secrets["bystander"], 4, "/api/chat")
        return refused, took_s, ollama, await asyncio.gather(*busy)


def test_a_request_finding_too_many_waiting_is_refused_at_once(stack, secrets):
    shared = stack.env
    stack.env, url = shared | {"CORTEX_QUEUE_MAX_WAITING": "3"}, stack.gateway_url
    try:
        stack.start_gateway()
        shedding = stack.gateway_url
    finally:
        stack.env, stack.gateway_url = shared, url
    refused, took_s, ollama, busy = asyncio.run(_too_many_waiting(stack, secrets, shedding))
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
    assert refused.json()["error"]["code"] == "queue_full" and took_s < 2
    assert ollama.status_code == 503 and "waiting for model" in ollama.json()["error"]
    assert [r.status_code for r in busy] == [200] * len(busy)
    assert not stack.client().exists(stack.keys.waiting_room(MODEL, "bystander"))
    assert_nothing_left(stack)
