"""What one API key can see of another's, with real keys (`cortex keys create`), two gateway replicas
and a real node agent: stored responses are their key's; one key's prompts leave no trace in
another's `cached_tokens` unless the fleet shares its prefix cache (`prefix_cache_scope`); `/metrics`
and `/v1/queue` show an anonymous scrape or a key only what they may see."""

import httpx
import openai
import pytest

from tests.integration.batch.conftest import MODEL
from tests.integration.keys.conftest import ADMIN_KEY, create_key
from tests.integration.keys.test_keys import openai_client

pytestmark = pytest.mark.integration

ENDS = ("response.completed", "response.incomplete")
SHORT = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 5}


def test_stored_responses_are_their_keys(keys_stack):
    first, second = keys_stack.replicas
    alice = openai_client(first, create_key(keys_stack, "resp-alice"))
    bob = openai_client(second, create_key(keys_stack, "resp-bob"))
    admin = openai_client(second, ADMIN_KEY)
    stored = alice.responses.create(**SHORT)
    streamed = [e for e in alice.responses.create(**SHORT, stream=True) if e.type in ENDS][
        0
    ].response
    for response_id in (stored.id, streamed.id):
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(response_id)
        with pytest.raises(openai.NotFoundError):
            list(bob.responses.retrieve(response_id, stream=True))
        with pytest.raises(openai.BadRequestError) as refused:
            bob.responses.create(**SHORT, previous_response_id=response_id)
        assert refused.value.code == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.input_items.list(response_id)
        assert (
            alice.responses.retrieve(response_id).output_text
            == admin.responses.retrieve(response_id).output_text
        )
        items = alice.responses.input_items.list(response_id).data
        assert [(i.role, i.content[0].text) for i in items] == [
            ("user", "Tell me a story.")
        ] and items[0].id
    assert alice.responses.create(**SHORT, previous_response_id=stored.id).status in (
        "completed",
        "incomplete",
    )
    assert len(list(alice.responses.retrieve(streamed.id, stream=True))) > 2
    alice.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(stored.id)
    keys_stack.assert_clean()


def _another_gateway(stack, **env: str) -> str:
    """The URL of one more gateway replica on the stack, with these settings besides the stack's."""
    shared = stack.env
    stack.env = shared | env
    try:
        stack.start_gateway()
    finally:
        stack.env = shared
    return stack.gateway_url


def _cached(client: openai.OpenAI, topic: str, **extra) -> int:
    """The cached prompt tokens of a chat whose long system prompt is about `topic`."""
    system = f"You answer questions about {topic}. " + "Be brief, be kind, cite nothing. " * 12
    answer = client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Why?"}],
        **extra,
    )
    return answer.usage.prompt_tokens_details.cached_tokens


def test_one_keys_prompts_are_cached_for_another_only_when_the_fleet_shares_its_cache(keys_stack):
    first, second = keys_stack.replicas
    alice_key, bob_key = create_key(keys_stack, "cache-alice"), create_key(keys_stack, "cache-bob")
    alice, bob = openai_client(first, alice_key), openai_client(second, bob_key)
    assert _cached(alice, "owls") == 0
    assert _cached(bob, "owls") == 0  # prefix_cache_scope = "key", the default
    assert _cached(alice, "owls") >= 16
    assert (
        _cached(alice, "owls", extra_body={"cache_salt": "s1"}) == 0
    )  # its own salt: apart from its unsalted prompts
    assert _cached(alice, "owls", extra_body={"cache_salt": "s1"}) >= 16

    fleet_url = _another_gateway(keys_stack, CORTEX_PREFIX_CACHE_SCOPE="fleet")
    alice, bob = openai_client(fleet_url, alice_key), openai_client(fleet_url, bob_key)
    assert _cached(alice, "bats") == 0
    assert _cached(bob, "bats") >= 16
    assert _cached(bob, "bats", extra_body={"cache_salt": "s2"}) == 0
    assert (
        _cached(alice, "bats", extra_body={"cache_salt": "s2"}) >= 16
    )  # the same salt in the fleet's scope


def _series(url: str, **headers: str) -> httpx.Response:
    return httpx.get(f"{url}/metrics", headers=headers, timeout=30)


def test_an_anonymous_scrape_sees_the_fleet_per_model_but_no_key_node_or_device(keys_stack):
    url = keys_stack.replicas[0]
    key = create_key(keys_stack, "metrics-carol")
    openai_client(url, key).chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
    )
    everything = _series(url, Authorization=f"Bearer {ADMIN_KEY}").text
    assert (
        'key="metrics-carol"' in everything
        and 'node="node-a"' in everything
        and "device=" in everything
    )
    for headers in ({}, {"Authorization": f"Bearer {key}"}):
        scraped = _series(url, **headers)
        assert scraped.status_code == 200
        assert (
            "metrics-carol" not in scraped.text
            and "node-a" not in scraped.text
            and "device=" not in scraped.text
        )
        assert "cortex:key_" not in scraped.text and "vllm:kv_cache_usage_perc" not in scraped.text
        served = [
            line
            for line in scraped.text.splitlines()
            if line.startswith("cortex:e2e_request_latency_seconds_count")
        ]
        assert served and all(
            float(line.split()[-1]) >= 1 for line in served
        )  # the fleet's, summed over nodes

    closed = _another_gateway(keys_stack, CORTEX_METRICS_REQUIRE_ADMIN_KEY="true")
    assert _series(closed).status_code == 401
    assert _series(closed, Authorization=f"Bearer {key}").status_code == 401
    assert _series(closed, Authorization=f"Bearer {ADMIN_KEY}").status_code == 200


def test_the_queue_shows_a_key_only_the_models_it_may_use(keys_stack):
    url = keys_stack.replicas[0]
    allowed = create_key(keys_stack, "queue-dave", "--models", MODEL)
    other = create_key(keys_stack, "queue-erin", "--models", "some-other-model")

    def models(key: str) -> set[str]:
        listed = httpx.get(
            f"{url}/v1/queue", headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        return {q["model"] for q in listed.json()["data"]}

    assert models(allowed) == {MODEL} == models(ADMIN_KEY)
    assert models(other) == set()
