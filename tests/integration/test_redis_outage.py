"""New requests during a short Redis outage wait for it (gateway/bus/outage.py): a real redis-server stopped
for a few seconds and started again from its snapshot, two gateway replicas (one with the default
wait, one allowing 1 s and one waiting request) and a node serving a tiny random model."""

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from shared.processes import redis_answers
from tests.conftest import Service
from tests.integration.fleet.conftest import catalogue
from tests.stack import Stack, start_stack

pytestmark = pytest.mark.integration

MODEL = "tiny-outage"
OUTAGE_S = (
    5.0  # longer than a request's first try (the Redis client's own retries take ~3 s), plus 1 s
)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_dirs) -> Iterator[Stack]:
    stack = start_stack(
        tmp_path_factory.mktemp("outage"), catalogue(tiny_dirs["llama"], **{MODEL: {}})
    )
    try:
        stack.start_gateway()
        stack.patient = stack.gateway_url
        stack.env |= {"CORTEX_REDIS_OUTAGE_WAIT_S": "1", "CORTEX_REDIS_OUTAGE_MAX_WAITING": "1"}
        stack.start_gateway()
        stack.start_node("n1", [MODEL])
        yield stack
    finally:
        stack.stop()


def stop_redis(stack: Stack) -> list[str]:
    """Stop the stack's redis-server after a snapshot of what it holds; returns how to start it again."""
    redis.Redis.from_url(stack.redis_url).save()
    stack.services[0].stop()
    return list(stack.services[0].proc.args)


def start_redis(stack: Stack, argv: list[str]) -> None:
    """From this thread (a child dies with the thread that started it, shared/processes.py)."""
    stack.services[0] = Service("redis-server", argv, stack.root / "redis-again.log")
    stack.services[0].wait_ready(lambda: redis_answers(stack.redis_url))


def test_new_requests_wait_out_a_short_outage_within_their_bounds(stack):
    answers: dict[str, httpx.Response] = {}

    def ask(name: str, url: str) -> None:
        answers[name] = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)

    assert (
        httpx.post(f"{stack.patient}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    )
    argv = stop_redis(stack)
    started = time.monotonic()
    asking = [
        threading.Thread(target=ask, args=(name, url))
        for name, url in (
            ("patient", stack.patient),
            ("brief-1", stack.gateway_url),
            ("brief-2", stack.gateway_url),
        )
    ]
    for thread in asking:
        thread.start()
    time.sleep(OUTAGE_S)
    start_redis(stack, argv)
    for thread in asking:
        thread.join(90)
    patient = answers["patient"]
    assert patient.status_code == 200, patient.text
    assert time.monotonic() - started >= OUTAGE_S  # it waited for Redis
    refused = sorted(answers[name].json()["error"]["message"] for name in ("brief-1", "brief-2"))
    assert [answers[name].status_code for name in ("brief-1", "brief-2")] == [503, 503]
    assert (
        "redis_outage_max_waiting" in refused[0] + refused[1]
        and "redis_outage_wait_s" in refused[0] + refused[1]
    )
    assert (
        httpx.post(f"{stack.gateway_url}/v1/chat/completions", json=CHAT, timeout=60).status_code
        == 200
    )
