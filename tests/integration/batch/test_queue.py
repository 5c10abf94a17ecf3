"""Queue visibility: a waiting streaming client sees its position count down; `/v1/queue` and
interactive TTFT while a batch runs (figures printed, never asserted)."""

import statistics
import threading
import time

import httpx
import pytest

from tests.integration.batch.conftest import MODEL, chat_line
from tests.integration.batch.test_batches import submit_batch, wait_completed_at_least, wait_status
from tests.stack import wait_for

pytestmark = pytest.mark.integration


def long_completion(base: str, max_tokens: int) -> None:
    httpx.post(
        f"{base}/v1/completions",
        json={
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )


def test_waiting_stream_sees_its_position_count_down(batch_stack):
    base = batch_stack.gateway_url
    # 8 take the slots, 22 wait ahead of our client: the tiny model ends a blocker in well under a
    # second on a quiet machine, so fewer would have drained before our client is queued
    blockers = [
        threading.Thread(target=long_completion, args=(base, 120 + 4 * i)) for i in range(30)
    ]
    for thread in blockers:
        thread.start()
        time.sleep(0.02)

    def tiny_queue() -> dict:
        return next(q for q in httpx.get(f"{base}/v1/queue").json()["data"] if q["model"] == MODEL)

    wait_for(lambda: tiny_queue()["running"] >= 1, 10, "the blockers running")
    assert tiny_queue()["replicas"] == 1
    positions, first_data = [], None
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        header = int(response.headers["x-cortex-queue-position"])
        for line in response.iter_lines():
            if line.startswith(": queued position="):
                positions.append(int(line.split("=")[1]))
            elif line.startswith("data:") and first_data is None:
                first_data = line
    for thread in blockers:
        thread.join()
    print(f"\nheader position {header}; comments {positions}")
    assert header >= 2 and positions and positions[0] == header
    assert positions == sorted(positions, reverse=True) and len(set(positions)) >= 2
    assert first_data is not None and first_data != "data: [DONE]"
    batch_stack.assert_clean()


def ttft_s(base: str, prompt: str) -> float:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - start
    raise AssertionError("no token")


def test_interactive_ttft_idle_and_during_a_200_line_batch(client, batch_stack):
    """Prints the figures; a 2-core machine's timings are never asserted."""
    base = batch_stack.gateway_url
    idle = [ttft_s(base, f"Question {i}?") for i in range(20)]
    batch_id = submit_batch(
        client,
        [
            chat_line(f"t-{i}", f"Batch item {i}.", max_tokens=64, ignore_eos=True)
            for i in range(200)
        ],
    )
    wait_completed_at_least(client, batch_id, 5)
    busy = []
    for i in range(20):
        busy.append(ttft_s(base, f"Question {i}?"))
        time.sleep(0.05)
    during = client.batches.retrieve(batch_id).request_counts
    done = wait_status(client, batch_id, {"completed", "failed"})
    p50_idle, p50_busy = statistics.median(idle), statistics.median(busy)
    print(
        f"\nTTFT p50 idle {p50_idle * 1000:.1f} ms, during the batch {p50_busy * 1000:.1f} ms "
        f"(ratio {p50_busy / p50_idle:.2f}); p90 idle {sorted(idle)[17] * 1000:.1f} ms, "
        f"during {sorted(busy)[17] * 1000:.1f} ms; batch lines done while measuring: {during.completed}; "
        f"batch {done.status}"
    )
    assert done.status == "completed"
