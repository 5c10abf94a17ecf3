"""A models directory that holds one model: pulling a second deletes the first while it is idle,
and fails naming it while it is loaded; `cortex models rm` deletes files a node does not use."""

import subprocess
import sys

import ollama
import pytest

from tests.integration.weights.conftest import catalogue, complete, cortex, node_env, pulls, send
from tests.stack import start_stack, wait_for

pytestmark = pytest.mark.integration


def test_a_budget_for_one_model_evicts_an_idle_one_and_refuses_past_a_loaded_one(
    tmp_path, hub, tiny_repo
):
    hub.publish("org/one", tiny_repo)
    hub.publish("org/two", tiny_repo)
    hub.start()
    models = tmp_path / "models-n1"
    stack = start_stack(tmp_path, catalogue(one="hf:org/one", two="hf:org/two"))
    try:  # one model's files take ~0.4 MB: 0.6 MB holds one, not two
        stack.start_gateway()
        node = stack.start_node(
            "n1", models=[], **node_env(tmp_path, "n1", hub, CORTEX_MODELS_DISK_GB="0.0006")
        )
        followed = cortex(
            stack, "models", "pull", "one"
        ).stdout  # follows the pull until the node has the files
        assert followed.startswith("pulling one on n1") and followed.endswith(
            "n1: has the files\n"
        ), followed
        assert complete(models, "org--one")
        send(stack, "n1", "pull", "two")
        wait_for(lambda: complete(models, "org--two"), 60, "two pulled")
        assert not (models / "org--one").exists()  # idle: deleted to make room
        assert "deleting the files of org--one" in node.log_path.read_text()

        send(stack, "n1", "load", "two")
        wait_for(
            lambda: stack.models_on("n1").get("two", {}).get("state") == "ready", 60, "two loaded"
        )
        refused = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "models", "pull", "one"],
            env=stack.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and "n1: failed: " in refused.stdout, refused.stdout
        error = pulls(stack, "n1")["org--one"]["error"]
        assert "models_disk_gb" in error and "org--two" in error and "two is ready here" in error, (
            error
        )
        with pytest.raises(ollama.ResponseError) as by_ollama:  # Ollama's /api/pull says the same
            ollama.Client(host=stack.gateway_url, timeout=60).pull("one", stream=False)
        assert (
            by_ollama.value.status_code == 503 and "n1 could not pull one" in by_ollama.value.error
        )
        assert "org--two (0.4 MB, two is ready here)" in by_ollama.value.error
        assert complete(models, "org--two")

        cortex(stack, "models", "rm", "two")  # loaded: the node keeps it
        wait_for(
            lambda: "the files of two (org--two) stay" in node.log_path.read_text(),
            10,
            "rm refused",
        )
        assert complete(models, "org--two")
        send(stack, "n1", "unload", "two")
        wait_for(lambda: "two" not in stack.models_on("n1"), 30, "two unloaded")
        assert (
            "deleting the files of two on n1"
            in cortex(stack, "models", "rm", "two", "--node", "n1").stdout
        )
        wait_for(lambda: not (models / "org--two").exists(), 10, "two's files deleted")
        wait_for(
            lambda: not stack.client().hexists(stack.keys.model_files("n1"), "org--two"),
            5,
            "unpublished",
        )
    finally:
        stack.stop()
