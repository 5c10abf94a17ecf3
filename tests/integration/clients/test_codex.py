"""The real OpenAI Codex CLI (npm `@openai/codex`, `codex exec`) on its defaults against a real stack
serving the scripted `codex` model through a custom provider with `wire_api = "responses"`: its
default request (function tools, a `namespace` of functions, a hosted `web_search` tool, a ~9k-token
prompt of message items with ids), a tool round trip (the model calls `exec_command` `ls`, Codex
runs it and sends its output back as a `function_call_output`, the model answers), and the answer
printed with exit 0. No field Codex sends is logged as unknown, and the web search it offers is
named in the log as not offered to the model.

Codex is installed from npm into ~/.cache/cortex/clients on first use (its npm package carries a
native binary); without npm or the registry the test is skipped and says why."""

import os
import subprocess
from pathlib import Path

import pytest

from gateway.dialects.protocol import responses, responses_input, responses_tools
from tests.integration.clients.conftest import ANSWER, npm_client

RUN_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def codex() -> Path:
    return npm_client("codex", "@openai/codex", "codex")


def codex_home(root: Path, gateway_url: str) -> Path:
    """`$CODEX_HOME/config.toml`: the stack as a custom provider; no retries, so a refusal shows at once."""
    home = root / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(f"""
model = "codex"
model_provider = "cortex"

[model_providers.cortex]
name = "Cortex"
base_url = "{gateway_url}/v1"
wire_api = "responses"
env_key = "CORTEX_API_KEY"
request_max_retries = 0
stream_max_retries = 0
""")
    return home


def test_codex_exec_on_its_defaults_with_a_tool_round_trip(codex, stack, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "cortex-notes.txt").write_text("hello\n")
    log = stack.root / "gateway.log"
    logged_before = log.read_text().count("\n")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "CORTEX_API_KEY": "unused",
        "CODEX_HOME": str(codex_home(tmp_path, stack.gateway_url)),
    }

    done = subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", "What files are here?"],
        cwd=project,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )

    assert done.returncode == 0, (
        f"codex exited {done.returncode}: {done.stdout[-2000:]} {done.stderr[-3000:]}"
    )
    assert (
        done.stdout.strip() == ANSWER
    )  # the model's answer to the tool's output: the round trip happened
    assert "/bin/bash -lc ls" in done.stderr  # Codex ran the call the model made
    new_lines = log.read_text().splitlines()[logged_before:]
    ours = set(vars(responses)) | set(vars(responses_input)) | set(vars(responses_tools))
    unknown = [
        line
        for line in new_lines
        if "ignoring unknown field" in line
        and line.split("ignoring unknown field ")[1].split(".")[0] in ours
    ]
    assert unknown == []
    assert any(
        "the model was not offered tools[" in line and "(web_search)" in line for line in new_lines
    )
