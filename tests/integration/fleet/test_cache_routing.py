"""Cache-aware routing with real node agents: a conversation's next turn goes to the node whose cache
holds its prefix; an evicted prefix is not routed to; a routed job its node cannot take moves to the
other node within `affinity_wait_ms`; a node killed with routed jobs waiting loses none of them."""

import os
import signal
import threading

import openai
import pytest

from tests.integration.fleet.conftest import catalogue
from tests.stack import start_stack, wait_for

pytestmark = pytest.mark.integration
MODEL = "tiny-a"


@pytest.fixture
def fleet(tmp_path, tiny_dirs, request):
    """A gateway and nodes n1, n2 serving MODEL (4 slots, a KV cache of 64 blocks of 16 tokens, unless
    the test's `models` marker says otherwise); settings from the test's `env` marker."""
    env_marker, models_marker = (
        request.node.get_closest_marker("env"),
        request.node.get_closest_marker("models"),
    )
    toml = catalogue(
        tiny_dirs["llama"],
        **{
            MODEL: {"slots": 4, "max_model_len": 256}
            | (models_marker.kwargs if models_marker else {})
        },
    )
    env = dict(
        CORTEX_JANITOR_INTERVAL_S="0.2",
        CORTEX_HEARTBEAT_S="0.3",
        CORTEX_HEARTBEAT_TTL_S="3",
        CORTEX_NODE_TTL_S="3",
    ) | (env_marker.kwargs if env_marker else {})
    stack = start_stack(tmp_path, toml, **env)
    try:
        stack.start_gateway()
        nodes = {
            name: stack.start_node(name, models=[MODEL], CORTEX_MEMORY_BUDGET_MB="500")
            for name in ("n1", "n2")
        }
        yield stack, nodes
    finally:
        stack.stop()


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=60)


def system_prompt(i: int) -> str:
    """About 100 tokens, different for each conversation from its first words on."""
    return f"Conversation {i}. " + " ".join(
        ["Tell me about transformers and attention in detail please."] * 8
    )


def turn(stack, messages: list[dict]):
    return client(stack).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0
    )


def held(stack) -> dict[str, int]:
    """How many prefix marks each node's cache holds."""
    r = stack.client()
    return {n: r.hlen(stack.keys.prefixes(MODEL, n)) for n in ("n1", "n2")}


def routed(stack) -> dict[str, int]:
    return {
        k.decode(): int(v) for k, v in stack.client().hgetall(stack.keys.routing(MODEL)).items()
    }


def first_turn(stack, i: int) -> tuple[list[dict], str, int]:
    """Turn 1 of conversation `i`: its messages so far, the node whose cache now holds it, and the
    tokens of its prompt (turn 2 finds at least their full blocks cached there)."""
    before = held(stack)
    messages = [
        {"role": "system", "content": system_prompt(i)},
        {"role": "user", "content": "Hello there!"},
    ]
    answer = turn(stack, messages)
    messages += [
        {"role": "assistant", "content": answer.choices[0].message.content},
        {"role": "user", "content": "Why? What is it?"},
    ]
    after = held(stack)
    [node] = [n for n in after if after[n] > before[n]]
    return messages, node, answer.usage.prompt_tokens


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_each_next_turn_goes_to_the_node_that_holds_its_conversation(fleet):
    stack, _ = fleet
    conversations = [first_turn(stack, i) for i in range(6)]
    for messages, _node, prompt_tokens in conversations:
        response = turn(stack, messages)
        assert cached(response) >= prompt_tokens // 16 * 16, (
            f"turn 2 found only {cached(response)} tokens cached"
        )
    counts = routed(stack)
    assert counts.get("cache") == 6, counts
    stack.assert_clean()


def test_an_evicted_prefix_is_no_longer_routed_to(fleet):
    stack, _ = fleet
    messages, node, _ = first_turn(stack, 0)
    r = stack.client()
    marks = set(r.hkeys(stack.keys.prefixes(MODEL, node)))
    shortest = min(int(tokens) for tokens in r.hvals(stack.keys.prefixes(MODEL, node)))
    for i in range(
        1, 40
    ):  # other long prompts fill both caches (64 blocks each) until the conversation is evicted
        turn(stack, [{"role": "user", "content": system_prompt(100 + i) * 2}])
        if not marks & set(r.hkeys(stack.keys.prefixes(MODEL, node))):
            break
    else:
        pytest.fail("the conversation's blocks were never evicted")
    routed_before = routed(stack)
    response = turn(stack, messages)
    # a cache frees a sequence's blocks tail first, so its first few blocks may outlive the blocks its
    # marks were anchored on; none of its marked prefixes is left
    assert cached(response) < shortest
    assert routed(stack).get("cache", 0) == routed_before.get(
        "cache", 0
    )  # not routed by cache any more
    stack.assert_clean()


def heartbeat_ms(stack, node: str) -> int:
    return int(stack.client().hget(stack.keys.node(node), "heartbeat_ms") or 0)


@pytest.mark.models(slots=1, max_model_len=1024)
@pytest.mark.env(
    CORTEX_HEARTBEAT_S="8",
    CORTEX_HEARTBEAT_TTL_S="30",
    CORTEX_NODE_TTL_S="30",
    CORTEX_AFFINITY_WAIT_MS="200",
)
def test_a_routed_job_its_busy_node_does_not_take_moves_to_the_other_nodes(fleet):
    """Both nodes busy (one slot each) while the heartbeat the gateway routes by still shows the
    conversation's node free: the turn is routed there, waits `affinity_wait_ms`, and moves. An
    attempt (two busy streams, then the turn, which waits for one of them to end) must fit between
    two heartbeats: 8 s apart, room for a loaded machine."""
    stack, _ = fleet
    messages, node, _ = first_turn(stack, 0)
    for _attempt in range(3):
        beat = heartbeat_ms(stack, node)
        wait_for(
            lambda: heartbeat_ms(stack, node) != beat, 20, "a fresh heartbeat"
        )  # the next is 8 s away
        beat = heartbeat_ms(stack, node)
        busy = [
            client(stack).completions.create(
                model=MODEL,
                prompt=f"Hello {i}",
                max_tokens=300,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for i in range(2)
        ]
        for stream in busy:
            next(iter(stream))  # it runs: each node's one slot is taken
        before = routed(stack)  # an attempt a heartbeat cut short may have been routed too
        response = turn(stack, messages)
        if (
            heartbeat_ms(stack, node) == beat
        ):  # the gateway saw the node free all along: it was routed there
            break
        for stream in busy:
            stream.close()
    else:
        pytest.fail("a heartbeat came between every attempt's jobs and its turn")
    after = routed(stack)
    counts = {way: after[way] - before.get(way, 0) for way in after}
    assert counts.get("cache") == 1 and counts.get("moved") == 1, counts
    assert response.usage.completion_tokens > 0
    for stream in busy:
        stream.close()
    stack.assert_clean(timeout_s=30)


@pytest.mark.env(CORTEX_AFFINITY_WAIT_MS="600000")
def test_a_killed_node_loses_none_of_the_jobs_routed_to_it(fleet):
    stack, nodes = fleet
    conversations = [first_turn(stack, i) for i in range(4)]
    node = max(("n1", "n2"), key=lambda n: sum(c[1] == n for c in conversations))
    mine = [messages for messages, holder, _ in conversations if holder == node]
    os.kill(nodes[node].proc.pid, signal.SIGSTOP)  # it reads nothing more; its heartbeat stops
    results: list = []
    threads = [
        threading.Thread(target=lambda m=m: results.append(turn(stack, m)), daemon=True)
        for m in mine
    ]
    for t in threads:
        t.start()
    r = stack.client()
    own = stack.keys.node_jobs(MODEL, node)
    # the first turn is routed to the stopped node (its last heartbeat shows it idle); the others may
    # be too, or, as the load this gateway sent there since that heartbeat outweighs their cached
    # prefix, go to the other node and end there
    wait_for(
        lambda: r.exists(own) and r.xlen(own) >= 1 and r.xlen(own) + len(results) == len(mine),
        10,
        "the turns to wait on the stopped node's stream or end on the other",
    )
    waiting = r.xlen(own)
    nodes[node].proc.kill()
    for t in threads:
        t.join(60)
    assert len(results) == len(mine) and all(res.choices[0].finish_reason for res in results)
    assert routed(stack).get("moved") == waiting
    wait_for(lambda: not r.exists(own), 10, "the dead node's own stream to go")
    stack.assert_clean(timeout_s=15)
