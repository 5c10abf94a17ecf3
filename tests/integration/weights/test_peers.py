"""Peers first: a node that needs a model fetches it from a node holding it (found in Redis), not
the hub; a node's file port serves only to holders of the fleet secret, and only its model folders."""

import httpx
import ollama
import openai
import pytest

from shared.processes import free_port
from tests.integration.weights.conftest import (
    FOLDER,
    NEEDED,
    REPO,
    catalogue,
    complete,
    folder_files,
    node_env,
    pulls,
)
from tests.stack import start_stack, wait_for

pytestmark = pytest.mark.integration

ADMIN_KEY, SECRET = "admin-key", "fleet-s3cret"
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # tests/hub_server.py's
PINNED, PINNED_FOLDER = f"{REPO}@{COMMIT}", f"{FOLDER}@{COMMIT}"


def peer_env(tmp_path, name: str, hub, port: int) -> dict[str, str]:
    return node_env(
        tmp_path,
        name,
        hub,
        CORTEX_FILE_PORT=str(port),
        CORTEX_FILE_HOST="127.0.0.1",
        CORTEX_FILE_URL=f"http://127.0.0.1:{port}",
        CORTEX_FLEET_SECRET=SECRET,
    )


def test_a_node_fetches_a_model_from_a_peer_once_the_hub_is_gone(tmp_path, hub, tiny_repo):
    hub.publish(REPO, tiny_repo)  # at COMMIT (without the hub, a peer's copy is of a pinned one)
    hub.start()
    stack = start_stack(
        tmp_path,
        catalogue(**{"tiny-a": f"hf:{PINNED}|a", "tiny-b": f"hf:{PINNED}|b"}),
        CORTEX_ADMIN_KEY=ADMIN_KEY,
        CORTEX_JANITOR_INTERVAL_S="0.5",
    )
    port_a, port_b = free_port(), free_port()
    try:
        stack.start_gateway()
        stack.start_node("a", models=[], **peer_env(tmp_path, "a", hub, port_a))
        node_b = stack.start_node("b", models=[], **peer_env(tmp_path, "b", hub, port_b))
        asked = httpx.post(
            f"{stack.gateway_url}/admin/models/tiny-a/pull",
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
            timeout=30,
        )
        assert asked.json() == {"model": "tiny-a", "nodes": ["a"]}  # only the nodes that may run it
        wait_for(
            lambda: stack.client().hexists(stack.keys.model_files("a"), PINNED_FOLDER),
            60,
            "node a to hold the model",
        )
        assert complete(tmp_path / "models-a", PINNED_FOLDER)
        hub.stop()

        client = openai.OpenAI(
            base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=120
        )
        assert client.completions.create(
            model="tiny-b", prompt="Hello", max_tokens=4, temperature=0
        ).choices
        assert folder_files(tmp_path / "models-b", PINNED_FOLDER) == NEEDED and complete(
            tmp_path / "models-b", PINNED_FOLDER
        )
        assert "from peer a" in node_b.log_path.read_text()
        assert pulls(stack, "b") == {}
        weights = [
            line
            for line in hub.requests()
            if line.startswith("GET") and "model.safetensors" in line
        ]
        assert len(weights) == 1  # node a's: node b never asked the hub

        files_b = f"http://127.0.0.1:{port_b}/files"
        auth = {"authorization": f"Bearer {SECRET}"}
        assert httpx.get(f"{files_b}/{PINNED_FOLDER}/config.json").status_code == 401
        assert (
            httpx.get(
                f"{files_b}/{PINNED_FOLDER}/config.json", headers={"authorization": "Bearer wrong"}
            ).status_code
            == 401
        )
        whole = httpx.get(f"{files_b}/{PINNED_FOLDER}/model.safetensors", headers=auth)
        assert (
            whole.status_code == 200
            and whole.content == (tiny_repo / "model.safetensors").read_bytes()
        )
        tail = httpx.get(
            f"{files_b}/{PINNED_FOLDER}/model.safetensors", headers=auth | {"range": "bytes=100-"}
        )
        assert tail.status_code == 206 and tail.content == whole.content[100:]
        (tmp_path / "secret.txt").write_text("not a model file")
        outside = httpx.get(f"{files_b}/{PINNED_FOLDER}/%2E%2E/%2E%2E/secret.txt", headers=auth)
        assert outside.status_code == 403 and b"not a model file" not in outside.content
        assert httpx.get(f"{files_b}/{PINNED_FOLDER}/.cache/x", headers=auth).status_code == 404
        stack.assert_clean()
        assert node_b.stop() == 0  # SIGTERM stops a node serving files too (uvicorn passes it on)
    finally:
        stack.stop()


def test_two_nodes_pulling_at_once_take_the_model_from_the_hub_once(tmp_path, hub, tiny_repo):
    hub.publish(REPO, tiny_repo)
    hub.start(
        throttle_bps=(tiny_repo / "model.safetensors").stat().st_size // 3
    )  # ~3 s: the second waits
    stack = start_stack(tmp_path, catalogue(tiny=f"hf:{REPO}"), CORTEX_ADMIN_KEY=ADMIN_KEY)
    try:
        stack.start_gateway()
        for name in ("a", "b"):
            stack.start_node(name, models=[], **peer_env(tmp_path, name, hub, free_port()))
        progress = list(
            ollama.Client(host=stack.gateway_url, timeout=120).pull("tiny", stream=True)
        )  # Ollama's client
        assert (
            progress[-1].status == "success"
            and complete(tmp_path / "models-a")
            and complete(tmp_path / "models-b")
        )
        moving = [p for p in progress[:-1] if p.total]
        assert {p.status for p in moving} <= {
            f"pulling {FOLDER} on a",
            f"pulling {FOLDER} on b",
        } and moving
        assert all(0 <= p.completed <= p.total for p in moving)  # a pull's first line: 0 of it
        assert any(p.completed for p in moving)
        weights = [
            line
            for line in hub.requests()
            if line.startswith("GET") and "model.safetensors" in line
        ]
        assert len(weights) == 1, weights  # one node from the hub, the other from it
        assert folder_files(tmp_path / "models-a") == folder_files(tmp_path / "models-b") == NEEDED
        stack.assert_clean()
    finally:
        stack.stop()


def test_a_peer_gone_before_its_heartbeat_expired_sends_the_node_to_the_hub(
    tmp_path, hub, tiny_repo
):
    hub.publish(REPO, tiny_repo)
    hub.start()
    stack = start_stack(tmp_path, catalogue(**{"tiny-a": f"hf:{REPO}|a", "tiny-b": f"hf:{REPO}|b"}))
    try:
        stack.start_gateway()
        node_a = stack.start_node(
            "a", models=["tiny-a"], **peer_env(tmp_path, "a", hub, free_port())
        )
        node_b = stack.start_node("b", models=[], **peer_env(tmp_path, "b", hub, free_port()))
        wait_for(
            lambda: stack.client().hexists(stack.keys.model_files("a"), FOLDER),
            10,
            "node a to publish it",
        )
        node_a.child.proc.kill()  # its heartbeat and holdings stay in Redis for their TTL
        client = openai.OpenAI(
            base_url=f"{stack.gateway_url}/v1", api_key="x", max_retries=0, timeout=120
        )
        assert client.completions.create(
            model="tiny-b", prompt="Hello", max_tokens=4, temperature=0
        ).choices
        log = node_b.log_path.read_text()
        assert "from a failed" in log and "from hub" in log and complete(tmp_path / "models-b")
    finally:
        stack.stop()
