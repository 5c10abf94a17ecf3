"""Ollama's API through the official npm `ollama` client (run by node: ollama_client.cjs), against a
real stack behind an API key sent as `Authorization: Bearer`: chat and generate streamed and not,
a tool round trip, `format` with a schema, embed, list, show, ps, pull, version and errors. Greedy answers
equal what `/v1/chat/completions` gives for the same request.

The package is installed from npm into ~/.cache/cortex/clients on first use; without node, npm or the
registry the test is skipped and says why."""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import openai
import pytest

from gateway.dialects.protocol import ollama as protocol_ollama
from tests import tiny_poolers
from tests.integration.clients.conftest import (
    ANSWER,
    OLLAMA_ADMIN_KEY,
    npm_library,
    unknown_fields,
)

SCRIPT = Path(__file__).with_name("ollama_client.cjs")
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def ollama_js() -> Path:
    if shutil.which("node") is None:
        pytest.skip(
            "node is not installed, so the npm ollama client cannot run (apt-get install nodejs npm)"
        )
    return npm_library("ollama-js", "ollama")


def test_npm_ollama_client(ollama_js, keyed_stack, ollama_embedder):
    log = keyed_stack.stack.root / "gateway.log"
    since = len(log.read_text().splitlines())
    done = subprocess.run(
        ["node", str(SCRIPT), str(ollama_js), keyed_stack.url, keyed_stack.key, OLLAMA_ADMIN_KEY],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    reference = openai.OpenAI(
        base_url=f"{keyed_stack.url}/v1", api_key=keyed_stack.key, max_retries=0
    )
    expected = reference.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        temperature=0,
        max_tokens=8,
    )
    text = expected.choices[0].message.content or ""

    assert got["chat"]["message"]["content"] == got["chatStream"]["text"] == text
    assert got["generate"]["response"] == got["generateStream"]["text"] == text
    for final in (
        got["chat"],
        got["chatStream"]["last"],
        got["generate"],
        got["generateStream"]["last"],
    ):
        assert final["done"] is True and final["done_reason"] == expected.choices[0].finish_reason
        assert (final["prompt_eval_count"], final["eval_count"]) == (
            expected.usage.prompt_tokens,
            expected.usage.completion_tokens,
        )
    assert [c["function"]["name"] for c in got["toolCalls"]] == ["Bash"]
    assert got["toolCalls"][0]["function"]["arguments"] == {"command": "ls"}
    assert got["afterTool"] == ANSWER
    assert isinstance(json.loads(got["format"])["ok"], bool)
    assert {"tiny:latest", "default:latest", "scripted:latest"} <= set(got["list"])
    assert got["show"]["capabilities"] == ["completion", "tools"]
    assert got["show"]["model_info"]["general.basename"] == "tiny"
    assert "tiny:latest" in [m["model"] for m in got["ps"]]
    assert got["pull"] == {"status": "success"}
    assert got["pullRefused"]["status"] == 403 and "admin key" in got["pullRefused"]["error"]
    expected_vectors = tiny_poolers.reference_vectors(
        ollama_embedder, ["Hello there", "The sea"]
    ).numpy()
    np.testing.assert_allclose(np.array(got["embed"]["embeddings"]), expected_vectors, atol=1e-4)
    assert tuple(int(part) for part in got["version"].split(".")) >= (0, 6, 4)
    assert got["unknown"]["status"] == 404 and "no-such-model" in got["unknown"]["error"]
    assert got["noKey"]["status"] == 401
    assert (
        unknown_fields(log, since, set(vars(protocol_ollama))) == []
    )  # every field it sends is known
