"""The fuzz tier: schemathesis generates requests from the gateway's own OpenAPI document for
the generation routes of every dialect, and the embedding and rerank routes (model fixed to the tiny
random chat model, completions kept short; embedding and rerank requests are validated, then refused
for it) and checks every answer: never a 5xx, a status the document declares, and a body that matches
its schema.
Bounded in examples per route and in seconds per request, so CI spends a minute or two on it."""

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.http.errors import OLLAMA_PATHS
from gateway.http.openapi import SUCCESS
from gateway.http.server import create_app
from shared.settings import GatewaySettings
from tests.integration.isolation.conftest import MODEL

pytestmark = [pytest.mark.integration, pytest.mark.fuzz]

EXAMPLES_PER_ROUTE = 12
REQUEST_TIMEOUT_S = 60  # a hang fails the test instead of stalling CI
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

schema = schemathesis.openapi.from_dict(create_app(GatewaySettings()).openapi()).include(
    path=list(SUCCESS)
)


def _small(body: dict, path: str) -> None:
    """The served model, and little work per request whatever else was drawn."""
    body["model"] = MODEL
    if path.startswith(OLLAMA_PATHS):
        options = body.get("options")
        body["options"] = (options if isinstance(options, dict) else {}) | {"num_predict": 4}
        return
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = 4
    body["n"] = 1 if "n" in body else None
    if body["n"] is None:
        del body["n"]
    body.pop("best_of", None)


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_ROUTE,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_fuzzed_requests_get_declared_answers_and_no_5xx(case, stack):
    if isinstance(case.body, dict):
        _small(case.body, case.path)
    response = case.call(base_url=stack.gateway_url, timeout=REQUEST_TIMEOUT_S)
    case.validate_response(response, checks=CHECKS)
