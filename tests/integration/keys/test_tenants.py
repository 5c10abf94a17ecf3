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
