"""One large result never cuts a gateway's link to Redis (issue 49): the stack's node bounds its
events at 64 KiB (`CORTEX_MAX_EVENT_BYTES`, conftest) and Redis here cuts a subscriber whose
output buffer passes 256 KB. An `/api/embed` of 2,000 inputs (a ~600 KB result) comes back whole
through `cortex:result:{job}`; the gateway's pub/sub connection is the one it had before, and a
stream running beside it ends as it would have."""

import threading

import httpx
import numpy as np
import pytest

from tests import tiny_poolers

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
