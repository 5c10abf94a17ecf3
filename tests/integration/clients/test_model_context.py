"""A catalogue `max_model_len` above the model's own context: the node runs the model's own, says
so at load with why, and `/v1/models` shows the context each model runs with (vLLM's `max_model_len`)."""

import httpx

from tests.integration.clients.conftest import CODEX_CONTEXT


def test_a_context_capped_by_the_model_is_logged_at_load_and_shown_in_v1_models(stack):
    models = {m["id"]: m for m in httpx.get(f"{stack.gateway_url}/v1/models").json()["data"]}
    assert models["codex"]["max_model_len"] == CODEX_CONTEXT  # the catalogue asks 32768
    assert (models["tiny"]["max_model_len"], models["default"]["max_model_len"]) == (
        256,
        256,
    )  # within the model's own
    assert models["scripted"]["max_model_len"] == 32768
    node_log = (stack.root / "node-node-c.log").read_text()
    assert (
        f"WARNING node_agent.model.loader: codex runs with a context of {CODEX_CONTEXT} tokens: max_model_len = "
        f"32768 in the catalogue is above the model's own context of {CODEX_CONTEXT} tokens"
    ) in node_log
    assert (
        "INFO node_agent.model.loader: tiny runs with a context of 256 tokens (max_model_len; its own is 512)"
        in node_log
    )
