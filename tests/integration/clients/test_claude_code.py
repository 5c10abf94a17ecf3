"""The real Claude Code CLI (npm `@anthropic-ai/claude-code`), headless, against a real stack
serving the scripted model: its default request (the full ~20k-token prompt with every tool,
system messages after the user turn, context_management, thinking, max_tokens 32000,
`?beta=true`), a tool round trip (the model calls Bash `ls`, Claude Code runs it and sends the
result back, the model answers), text and stream-json output, and `--continue`.

Claude Code is installed from npm into ~/.cache/cortex/clients (outside the repo) on first use;
without npm or the registry the test is skipped and says why."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.clients.conftest import ANSWER, npm_client

RUN_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def claude() -> Path:
    return npm_client("claude-code", "@anthropic-ai/claude-code", "claude")


def run_claude(claude: Path, stack, project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(project.parent / "home"),
        "ANTHROPIC_BASE_URL": stack.gateway_url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": "scripted",
        "ANTHROPIC_SMALL_FAST_MODEL": "scripted",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "scripted",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    done = subprocess.run(
        [str(claude), "-p", *args, "--allowedTools", "Bash"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, (
        f"claude exited {done.returncode}: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    )
    return done


def test_claude_code_headless_with_a_tool_round_trip_and_continue(claude, stack, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "cortex-notes.txt").write_text("hello\n")

    first = run_claude(claude, stack, project, "What files are here?", "--output-format", "text")
    assert (
        first.stdout.strip() == ANSWER
    )  # the tool ran and its result came back: the model's answer to it

    again = run_claude(
        claude,
        stack,
        project,
        "--continue",
        "And now?",
        "--output-format",
        "stream-json",
        "--verbose",
    )
    messages = [json.loads(line) for line in again.stdout.splitlines() if line.strip()]
    calls = [
        b
        for m in messages
        if m["type"] == "assistant"
        for b in m["message"]["content"]
        if b["type"] == "tool_use"
    ]
    results = [
        b
        for m in messages
        if m["type"] == "user"
        for b in m["message"]["content"]
        if b["type"] == "tool_result"
    ]
    assert [(c["name"], c["input"]) for c in calls] == [("Bash", {"command": "ls"})]
    assert "cortex-notes.txt" in json.dumps(results[0]["content"])
    [result] = [m for m in messages if m["type"] == "result"]
    assert result["subtype"] == "success" and result["result"] == ANSWER
    assert (
        result["usage"]["input_tokens"] > 15_000
    )  # Claude Code's whole default prompt, and the first run's turns
