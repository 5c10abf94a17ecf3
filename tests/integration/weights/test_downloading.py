"""A node placed for a model it lacks downloads it first: the replica is `downloading`, with bytes
done / total and a rate in its heartbeat, `cortex status` and `/v1/models`; then it loads and
serves the request that caused it."""

import json
import threading

import httpx
import openai
import pytest

from tests.integration.weights.conftest import REPO, catalogue, cortex, node_env
from tests.stack import start_stack, wait_for

pytestmark = pytest.mark.integration


def test_a_placed_node_downloads_the_model_with_visible_progress_then_serves(
    tmp_path, hub, tiny_repo
):
    hub.publish(REPO, tiny_repo)
    weights = (tiny_repo / "model.safetensors").stat().st_size
    hub.start(throttle_bps=weights // 12)  # ~12 s for the weights
    unsized = f'[[models]]\nid = "unsized"\nsource = "hf:{REPO}"\n'  # no memory_mb: nothing to estimate it from
    stack = start_stack(
        tmp_path, catalogue(tiny=f"hf:{REPO}") + unsized, CORTEX_JANITOR_INTERVAL_S="0.5"
    )
    try:
        stack.start_gateway()
        stack.start_node("n1", models=[], **node_env(tmp_path, "n1", hub))
        client = openai.OpenAI(
            base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=120
        )
        answers = []
        asking = threading.Thread(
            target=lambda: answers.append(
                client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
            )
        )
        asking.start()

        def downloading() -> dict | None:
            model = json.loads(cortex(stack, "status", "--json").stdout)["nodes"][0]["models"].get(
                "tiny"
            )
            if (
                model
                and model["state"] == "downloading"
                and 0 < model["download"]["bytes_done"] < weights
            ):
                return model
            return None

        wait_for(downloading, 60, "a replica downloading, part of the way")
        progress = downloading() or {}
        assert progress.get("download", {}).get("source") == "hub"
        assert (
            progress["download"]["bytes_total"] > weights and progress["download"]["rate_bps"] > 0
        )
        shown = cortex(stack, "status").stdout
        assert "downloading" in shown and "from hub" in shown, shown
        listed = {m["id"]: m for m in httpx.get(f"{stack.gateway_url}/v1/models").json()["data"]}[
            "tiny"
        ]
        assert (
            listed["state"] == "downloading" and 0 < listed["replicas"][0]["download_fraction"] < 1
        )

        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="unsized", prompt="Hello", max_tokens=4)
        assert refused.value.status_code == 503 and "set memory_mb" in refused.value.body["message"]

        asking.join(120)
        assert answers and answers[0].choices[0].text is not None
        assert (
            stack.models_on("n1")["tiny"]["state"] == "ready"
            and stack.models_on("n1")["tiny"]["download"] is None
        )
        stack.assert_clean()
    finally:
        stack.stop()
