"""Pulls from a hub on loopback with the real `huggingface_hub` client, in a real node agent: only
the files a model needs, HF_TOKEN sent, a transfer cut half-way resumed where it stopped, and a
file whose hash is not the hub's refused and never loaded."""

import sys
import time

import pytest

from tests.conftest import Service
from tests.integration.weights.conftest import (
    FOLDER,
    NEEDED,
    REPO,
    catalogue,
    complete,
    folder_files,
    node_env,
    partial_bytes,
    pulls,
    send,
)
from tests.stack import start_stack, wait_for

pytestmark = pytest.mark.integration


def test_a_pull_takes_only_what_the_model_needs_and_resumes_after_the_hub_died(
    tmp_path, hub, tiny_repo
):
    hub.publish(REPO, tiny_repo)
    weights = (tiny_repo / "model.safetensors").stat().st_size
    hub.start(
        throttle_bps=weights // 6, token="hf_secret"
    )  # ~6 s for the weights; 401 without the token
    models = tmp_path / "models-n1"
    stack = start_stack(tmp_path, catalogue(tiny=f"hf:{REPO}"))
    try:
        stack.start_node("n1", models=[], **node_env(tmp_path, "n1", hub, HF_TOKEN="hf_secret"))
        send(stack, "n1", "pull", "tiny")
        wait_for(lambda: partial_bytes(models) > weights // 3, 60, "a third of the weights")
        hub.stop()
        wait_for(lambda: pulls(stack, "n1").get(FOLDER, {}).get("error"), 60, "the pull to fail")
        kept = partial_bytes(models)
        assert 0 < kept < weights and not complete(models)
        assert "model.safetensors" in pulls(stack, "n1")[FOLDER]["error"]

        before = len(hub.requests())
        hub.start(token="hf_secret")
        send(stack, "n1", "pull", "tiny")
        wait_for(lambda: complete(models), 60, "the pull to finish")
        resumed = [
            line
            for line in hub.requests()[before:]
            if line.startswith("GET") and "model.safetensors" in line
        ]
        assert len(resumed) == 1 and f"bytes={kept}-" in resumed[0], (
            resumed
        )  # from where it stopped
        assert folder_files(models) == NEEDED  # no README, no second copy of the weights
        assert (models / FOLDER / "model.safetensors").read_bytes() == (
            tiny_repo / "model.safetensors"
        ).read_bytes()
        wait_for(
            lambda: stack.client().hexists(stack.keys.model_files("n1"), FOLDER),
            5,
            "the folder published",
        )
        assert not any("pytorch_model.bin" in line or "README" in line for line in hub.requests())
    finally:
        stack.stop()


def test_a_file_corrupted_on_the_hub_is_refused_and_never_loaded(tmp_path, hub, tiny_repo):
    hub.publish(REPO, tiny_repo)
    served = hub.root / "repos" / REPO / "model.safetensors"
    data = bytearray(served.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte off: only the hash can tell
    served.write_bytes(bytes(data))
    hub.start()
    models = tmp_path / "models-n1"
    stack = start_stack(tmp_path, catalogue(tiny=f"hf:{REPO}"))
    try:
        node = stack.start_node("n1", models=[], **node_env(tmp_path, "n1", hub))
        send(stack, "n1", "load", "tiny")
        wait_for(
            lambda: stack.models_on("n1").get("tiny", {}).get("state") == "failed",
            60,
            "the load to fail",
        )
        error = stack.models_on("n1")["tiny"]["error"]
        assert error.startswith("ModelFileCorrupt") and "model.safetensors has sha256" in error, (
            error
        )
        assert not complete(models) and "model.safetensors" not in folder_files(models)
        assert "loading tiny from" not in node.log_path.read_text()  # the engine never read it
    finally:
        stack.stop()


def test_a_node_stopped_while_it_downloads_a_model_at_start_stops_at_once(tmp_path, hub, tiny_repo):
    hub.publish(REPO, tiny_repo)
    hub.start(throttle_bps=4096)  # ~100 s for the weights
    stack = start_stack(tmp_path, catalogue(tiny=f"hf:{REPO}"))
    env = (
        stack.env
        | node_env(tmp_path, "n1", hub)
        | {"CORTEX_NODE_NAME": "n1", "CORTEX_MODELS": '["tiny"]'}
    )
    node = Service(
        "node n1", [sys.executable, "-m", "node_agent"], tmp_path / "node-n1.log", env=env
    )
    try:
        node.wait_ready(
            lambda: stack.models_on("n1").get("tiny", {}).get("state") == "downloading", 60
        )
        started = time.monotonic()
        assert (
            node.stop(timeout_s=20) == 0 and time.monotonic() - started < 10
        )  # not after the download
        log = node.log_path.read_text()
        assert "the node is shutting down" in log and "node n1 stopped" in log
        assert stack.client().exists(stack.keys.node("n1"), stack.keys.model_files("n1")) == 0
    finally:
        node.stop()
        stack.stop()
