"""Streaming jobs a node had read but not started when it died are served by another replica."""

import os
import signal
import threading

import openai
import pytest

from shared.keys import CONSUMER_GROUP
from tests.integration.fleet.test_failures import client, join_all
from tests.stack import wait_for

pytestmark = pytest.mark.integration


@pytest.mark.models(**{"tiny-a": {"slots": 8}})
def test_streams_waiting_for_their_first_token_survive_a_killed_node(fleet_stack):
    fleet_stack.start_gateway()
    victim = fleet_stack.start_node("n1", models=["tiny-a"], CORTEX_MEMORY_BUDGET_MB="500")
    fleet_stack.start_node(
        "n2", models=[], CORTEX_MEMORY_BUDGET_MB="500"
    )  # takes the model once n1 is gone
    redis, stream = fleet_stack.client(), fleet_stack.keys.jobs("tiny-a")
    wait_for(
        lambda: any(c["cmd"] == "xreadgroup" and "b" in c["flags"] for c in redis.client_list()),
        10,
        "n1 to block reading its stream",
    )
    os.kill(victim.proc.pid, signal.SIGSTOP)  # blocked in XREADGROUP: Redis still hands it entries
    outcomes: list = []

    def one(i: int) -> None:
        try:
            chunks = client(fleet_stack).completions.create(
                model="tiny-a",
                prompt=f"Hello {i}",
                max_tokens=8,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            outcomes.append(sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].text))
        except openai.APIError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(8)]
    for thread in threads:
        thread.start()
    wait_for(lambda: redis.xlen(stream) >= 1, 10, "a job to be queued")
    # What n1's blocked read does when it is still blocked; its BLOCK may have timed out while it was
    # stopped, so take what waits in its name (a read it never got to start), as that read would.
    redis.xreadgroup(CONSUMER_GROUP, "n1", {stream: ">"}, count=8)
    assert redis.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10, consumername="n1")
    os.kill(victim.proc.pid, signal.SIGKILL)
    join_all(threads, 180)
    assert len(outcomes) == 8 and all(isinstance(o, int) and o > 0 for o in outcomes), outcomes
    assert "tiny-a" in fleet_stack.models_on("n2")
    fleet_stack.assert_clean()
