"""Cold loads, LRU eviction, pins, keep_alive and capacity errors, on one node with a 250 MB budget."""

import threading
import time

import httpx
import openai
import pytest

from tests.integration.fleet.conftest import ADMIN_KEY
from tests.stack import wait_for

pytestmark = pytest.mark.integration


def ask(stack, model: str, **kw):
    client = openai.OpenAI(
        base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=60
    )
    return client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0, **kw)


def use(stack, model: str) -> None:
    """Ask `model`, then wait for n1's heartbeat to say so: placement sees use through heartbeats."""
    since_ms = int(time.time() * 1000)
    ask(stack, model)
    wait_for(
        lambda: stack.models_on("n1")[model]["last_used_ms"] >= since_ms,
        10,
        f"n1's heartbeat to say {model} was used",
    )


def admin(stack, path: str) -> httpx.Response:
    return httpx.post(
        f"{stack.gateway_url}/admin/{path}",
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )


@pytest.mark.models(**{"tiny-a": {}, "tiny-b": {}, "tiny-c": {}, "tiny-huge": {"memory_mb": 1000}})
def test_cold_load_lru_eviction_pins_and_capacity(fleet_stack):
    fleet_stack.start_gateway()
    fleet_stack.start_node("n1", models=[], CORTEX_MEMORY_BUDGET_MB="250")
    assert fleet_stack.models_on("n1") == {}

    assert ask(fleet_stack, "tiny-a").choices  # cold load on first use
    assert ask(fleet_stack, "tiny-b").choices
    assert set(fleet_stack.models_on("n1")) == {"tiny-a", "tiny-b"}
    use(fleet_stack, "tiny-a")  # tiny-b is now the least recently used
    assert ask(fleet_stack, "tiny-c").choices
    wait_for(lambda: set(fleet_stack.models_on("n1")) == {"tiny-a", "tiny-c"}, 10, "tiny-b evicted")

    assert admin(fleet_stack, "models/tiny-a/pin").status_code == 200
    use(fleet_stack, "tiny-c")  # tiny-a is now LRU, but pinned
    assert ask(fleet_stack, "tiny-b").choices
    wait_for(
        lambda: set(fleet_stack.models_on("n1")) == {"tiny-a", "tiny-b"},
        10,
        "tiny-c evicted, not tiny-a",
    )

    with pytest.raises(openai.APIStatusError) as caught:
        ask(fleet_stack, "tiny-huge")
    assert caught.value.status_code == 503
    error = caught.value.body
    assert error["code"] == "insufficient_capacity"
    assert "needs 1000 MB" in error["message"] and "n1" in error["message"]
    fleet_stack.assert_clean()


@pytest.mark.models(
    **{"tiny-a": {"keep_alive_s": 1.0}, "tiny-b": {"pin": True, "keep_alive_s": 1.0}}
)
def test_keep_alive_unloads_idle_models_but_not_pinned_ones(fleet_stack):
    fleet_stack.start_gateway()
    fleet_stack.start_node("n1", models=[], CORTEX_MEMORY_BUDGET_MB="1000")
    ask(fleet_stack, "tiny-a")
    ask(fleet_stack, "tiny-b")
    wait_for(
        lambda: set(fleet_stack.models_on("n1")) == {"tiny-b"},
        15,
        "tiny-a unloaded after keep_alive",
    )
    ask(fleet_stack, "tiny-a", extra_body={"keep_alive": "30s"})  # a request may keep it longer
    time.sleep(3)
    assert set(fleet_stack.models_on("n1")) == {"tiny-a", "tiny-b"}
    fleet_stack.assert_clean()


@pytest.mark.models(**{"tiny-a": {}})
def test_two_gateways_placing_at_once_load_the_model_once(fleet_stack):
    fleet_stack.start_gateway()
    first = fleet_stack.gateway_url
    fleet_stack.start_gateway()
    second = fleet_stack.gateway_url
    for name in ("n1", "n2", "n3"):
        fleet_stack.start_node(name, models=[], CORTEX_MEMORY_BUDGET_MB="500")
    answers, errors = [], []

    def one(url):
        try:
            client = openai.OpenAI(
                base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180
            )  # a cold load on a busy box took over 60 s
            answers.append(client.completions.create(model="tiny-a", prompt="Hi", max_tokens=3))
        except Exception as exc:  # collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(url,)) for url in [first, second] * 5]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert errors == [] and len(answers) == 10
    holders = [n for n in ("n1", "n2", "n3") if "tiny-a" in fleet_stack.models_on(n)]
    assert len(holders) == 1
    fleet_stack.assert_clean()


@pytest.mark.models(**{"tiny-a": {}})
def test_admin_api_needs_the_key_and_cli_status_shows_the_fleet(fleet_stack):
    import json
    import subprocess
    import sys

    fleet_stack.start_gateway()
    fleet_stack.start_node("n1", models=["tiny-a"], CORTEX_MEMORY_BUDGET_MB="500")
    response = httpx.post(f"{fleet_stack.gateway_url}/admin/models/tiny-a/pin", timeout=10)
    assert (
        response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    )
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "status", "--json"],
        env=fleet_stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    status = json.loads(out.stdout)
    [node] = status["nodes"]
    assert node["node"] == "n1" and node["alive"]
    assert node["devices"][0]["total_mb"] == 500
    assert "tiny-a" in json.dumps(node["models"])


def chat(stack, model: str):
    """Greedy, with a system prompt of several KV blocks (a prefix a kept cache answers from)."""
    client = openai.OpenAI(
        base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=60
    )
    return client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You answer questions about attention. " * 12},
            {"role": "user", "content": "Hello"},
        ],
        max_tokens=6,
        temperature=0,
    )


def state_on(stack, node: str, model: str) -> str | None:
    return stack.models_on(node).get(model, {}).get("state")


@pytest.mark.models(
    **{"tiny-a": {"keep_alive_s": 1.0}, "tiny-b": {"keep_alive_s": 600}, "tiny-c": {}}
)
def test_an_idle_model_sleeps_wakes_with_its_cache_and_is_evicted_first(fleet_stack):
    """With `sleep_mb`, a model idle past its keep_alive sleeps (its engine kept); the next request
    wakes it (the same greedy answer, its prompt's prefix still cached: nothing was reloaded); a model
    placed on the full node evicts the sleeping model before an idle ready one used longer ago."""
    fleet_stack.start_gateway()
    fleet_stack.start_node("n1", models=[], CORTEX_MEMORY_BUDGET_MB="250", CORTEX_SLEEP_MB="1000")
    ask(fleet_stack, "tiny-b")  # the least recently used from now on
    first = chat(fleet_stack, "tiny-a")
    wait_for(lambda: state_on(fleet_stack, "n1", "tiny-a") == "sleeping", 15, "tiny-a to sleep")
    woken = chat(fleet_stack, "tiny-a")
    assert woken.choices[0].message.content == first.choices[0].message.content
    assert woken.usage.prompt_tokens_details.cached_tokens >= 16, woken.usage
    assert state_on(fleet_stack, "n1", "tiny-a") == "ready"

    wait_for(
        lambda: state_on(fleet_stack, "n1", "tiny-a") == "sleeping", 15, "tiny-a to sleep again"
    )
    assert ask(fleet_stack, "tiny-c").choices  # no room for three: the sleeping one goes
    wait_for(
        lambda: set(fleet_stack.models_on("n1")) == {"tiny-b", "tiny-c"},
        15,
        "the sleeping tiny-a evicted, not the idle tiny-b",
    )
    fleet_stack.assert_clean()
