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
    streamed = [e for e in alice.responses.create(**SHORT, stream=True) if e.type in ENDS][0].response
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
        assert alice.responses.retrieve(response_id).output_text == admin.responses.retrieve(response_id).output_text
    assert alice.responses.create(**SHORT, previous_response_id=stored.id).status in ("completed", "incomplete")
    assert len(list(alice.responses.retrieve(streamed.id, stream=True))) > 2
    alice.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(stored.id)
    keys_stack.assert_clean()


def _cached(client: openai.OpenAI, topic: str, **extra) -> int:
    """The cached prompt tokens of a chat whose long system prompt is about `topic`."""
    system = f"You answer questions about {topic}. " + "Be brief, be kind, cite nothing. " * 12
    answer = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Why?"}], **extra)
    return answer.usage.prompt_tokens_details.cached_tokens


def test_one_keys_prompts_are_cached_for_another_only_when_the_fleet_shares_its_cache(keys_stack):
    first, second = keys_stack.replicas
    alice_key, bob_key = create_key(keys_stack, "cache-alice"), create_key(keys_stack, "cache-bob")
    alice, bob = openai_client(first, alice_key), openai_client(second, bob_key)
    assert _cached(alice, "owls") == 0
    assert _cached(bob, "owls") == 0  # prefix_cache_scope = "key", the default
    assert _cached(alice, "owls") >= 16
    assert _cached(alice, "owls", extra_body={"cache_salt": "s1"}) == 0  # its own salt: apart from its unsalted prompts
    assert _cached(alice, "owls", extra_body={"cache_salt": "s1"}) >= 16

    env = keys_stack.env
    keys_stack.env = env | {"CORTEX_PREFIX_CACHE_SCOPE": "fleet"}
    try:
        keys_stack.start_gateway()
    finally:
        keys_stack.env = env
    alice, bob = openai_client(keys_stack.gateway_url, alice_key), openai_client(keys_stack.gateway_url, bob_key)
    assert _cached(alice, "bats") == 0
    assert _cached(bob, "bats") >= 16
    assert _cached(bob, "bats", extra_body={"cache_salt": "s2"}) == 0
    assert _cached(alice, "bats", extra_body={"cache_salt": "s2"}) >= 16  # the same salt in the fleet's scope
