"""One large result never cuts a gateway's link to Redis (issue 49): the stack's node bounds its
events at 64 KiB (`CORTEX_MAX_EVENT_BYTES`, conftest) and Redis here cuts a subscriber whose
output buffer passes 256 KB. An `/api/embed` of 2,000 inputs (a ~600 KB result) comes back whole
through `cortex:result:{job}`; the gateway's pub/sub connection is the one it had before, and a
stream running beside it ends as it would have. When Redis cuts the gateway's pub/sub connection
anyway, its jobs read on from their event logs: a stream ends with every token once, an answer not
streamed comes back whole."""

import json
import threading
import time

import httpx
import numpy as np
import pytest

from tests import tiny_poolers
from tests.stack import wait_for

pytestmark = pytest.mark.integration

INPUTS = 2000


def pubsub_clients(client) -> set[str]:
    return {entry["id"] for entry in client.client_list(_type="pubsub")}


def test_a_result_over_the_event_bound_arrives_whole_and_the_link_holds(stack, pooler_dirs):
    client = stack.client()
    before = pubsub_clients(client)
    limit = client.config_get("client-output-buffer-limit")["client-output-buffer-limit"]
    client.config_set("client-output-buffer-limit", "pubsub 256kb 0 0")
    bystander: dict = {}
    started = threading.Event()

    def stream_beside() -> None:
        body = {"model": "chat", "prompt": "a b c", "max_tokens": 64, "stream": True}
        with httpx.stream(
            "POST", f"{stack.gateway_url}/v1/completions", json=body, timeout=60
        ) as answer:
            lines = []
            for line in answer.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
            bystander["lines"] = lines
        started.set()

    beside = threading.Thread(target=stream_beside)
    try:
        beside.start()
        started.wait(30)
        texts = ["a", "b", "c", "d"] * (INPUTS // 4)
        answer = httpx.post(
            f"{stack.gateway_url}/api/embed",
            json={"model": "embed", "input": texts},
            timeout=120,
        )
        beside.join(60)
    finally:
        client.config_set("client-output-buffer-limit", limit)
    assert answer.status_code == 200, answer.text
    vectors = np.array(answer.json()["embeddings"])
    assert vectors.shape == (INPUTS, 64)
    expected = tiny_poolers.reference_vectors(pooler_dirs["embed"], texts[:4]).numpy()
    np.testing.assert_allclose(vectors[-4:], expected, atol=1e-4)
    assert pubsub_clients(client) == before  # the gateway's subscriber was never cut
    assert bystander["lines"][-1] == "data: [DONE]"
    assert not any("error" in line for line in bystander["lines"])
    assert client.keys("cortex:result:*") == []  # read once by the gateway, then deleted


# ---- a link Redis cuts anyway (`CLIENT KILL TYPE pubsub`): jobs read on from their event logs ----

LONG = {
    "model": "chat",
    "prompt": "Once upon a time",
    "temperature": 0,
    "max_tokens": 200,
    "ignore_eos": True,
}


def cut_subscribers(stack) -> int:
    """Every pub/sub connection on the stack's Redis (the gateway's event router among them)."""
    return stack.client().client_kill_filter(_type="pubsub")


def streamed(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def text_of(datas: list[str]) -> str:
    chunks = [json.loads(d) for d in datas if d != "[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def test_a_stream_goes_on_from_its_log_after_redis_cuts_the_gateways_link(stack):
    whole = httpx.post(f"{stack.gateway_url}/v1/completions", json=LONG, timeout=120).json()
    body = LONG | {"stream": True}
    with httpx.stream(
        "POST", f"{stack.gateway_url}/v1/completions", json=body, timeout=120
    ) as answer:
        lines = answer.iter_lines()
        part = []
        for line in lines:
            part += streamed([line])
            if len(part) == 20:
                break
        assert cut_subscribers(stack) >= 1
        rest = streamed(lines)
    datas = part + rest
    assert datas[-1] == "[DONE]" and not any('"error"' in d for d in datas)
    assert text_of(datas) == whole["choices"][0]["text"]  # every token once, in order
    assert len(datas) > 100  # it was cut half-way


def test_an_answer_not_streamed_comes_back_whole_after_the_link_is_cut(stack):
    whole = httpx.post(f"{stack.gateway_url}/v1/completions", json=LONG, timeout=120).json()
    client = stack.client()
    logs_before = set(client.keys("cortex:eventlog:*"))
    got: dict = {}

    def ask() -> None:
        got["answer"] = httpx.post(f"{stack.gateway_url}/v1/completions", json=LONG, timeout=120)

    asking = threading.Thread(target=ask)
    asking.start()
    deadline = time.monotonic() + 30
    while not any(
        client.xlen(key) > 2 for key in set(client.keys("cortex:eventlog:*")) - logs_before
    ):
        assert time.monotonic() < deadline, "the job never ran"  # its start and a delta: it runs
        time.sleep(0.01)
    cut_subscribers(stack)
    asking.join(120)
    answer = got["answer"]
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == whole["choices"][0]["text"]
    assert answer.json()["usage"] == whole["usage"]
    wait_for(  # deleted at its end: nobody can resume it (a stream's log stays, for resuming)
        lambda: set(client.keys("cortex:eventlog:*")) <= logs_before, what="its log deleted"
    )
