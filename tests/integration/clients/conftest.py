"""Real clients against a whole stack (redis-server, the gateway under uvicorn, one node agent)
serving tiny models: `tiny` (random weights, 256-token context, default_max_tokens 8, alias
`default`), `tiny-strict` (the same under max_tokens_policy "reject"), `scripted` (a 32k
context and a scripted tool call, for Claude Code: see tests/tiny_models.build_scripted) and
`codex` (the same for the Codex CLI, whose own context of 16k is below the catalogue's 32k).

Clients from npm are installed into ~/.cache/cortex/clients (outside the repo) on first use and
kept there for later runs (`npm_client`); without npm or its registry their tests are skipped."""

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import tiny_models, tiny_poolers
from tests.stack import Stack, checked, serving

# After a tool result the template ends the prompt with "Result:", so the scripted model answers
# instead of calling the tool again.
SCRIPTED_TEMPLATE = (
    "{%- set ns = namespace(answered=false) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{%- set ns.answered = false -%}"
    "{%- elif '<tool_response>' in m['content'] -%}{%- set ns.answered = true -%}{%- endif -%}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{% if ns.answered %}Result:{% endif %}{%- endif -%}"
)
TOOL_CALL = (
    '<tool_call>{"name":"Bash","arguments": {"command" : "ls"} }'  # spelt so that no token repeats
)
# Codex's tool names take an underscore, as `<tool_call>` does: the bare JSON call (llama3_json) has only one.
CODEX_TOOL_CALL = '{"name":"exec_command","arguments": {"cmd" : "ls"} }'
CODEX_CONTEXT = 16384  # its config's max_position_embeddings; the catalogue asks 32768
ANSWER = "Done."

CLIENTS_DIR = Path(
    os.environ.get("CORTEX_TEST_CLIENTS_DIR", Path.home() / ".cache" / "cortex" / "clients")
)


def npm_client(folder: str, package: str, binary: str) -> Path:
    """`binary` of the npm `package`, installed into CLIENTS_DIR/`folder` the first time; skips the
    test, saying why, when npm or its registry cannot be had."""
    return npm_install(folder, package, Path("node_modules") / ".bin" / binary)


def npm_library(folder: str, package: str) -> Path:
    """The folder of the npm library `package` (to `require`), installed as `npm_client` installs."""
    return npm_install(folder, package, Path("node_modules") / package)


def npm_install(folder: str, package: str, wanted: Path) -> Path:
    """CLIENTS_DIR/`folder`/`wanted`, installing `package` there first when it is missing."""
    prefix = CLIENTS_DIR / folder
    path = prefix / wanted
    if not path.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip(
                f"npm is not installed, so {package} cannot be (apt-get install nodejs npm)"
            )
        prefix.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix), package],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0 or not path.exists():
            pytest.skip(
                f"npm could not install {package} (registry unreachable?): {done.stderr.strip()[-500:]}"
            )
    return path


@pytest.fixture(scope="session")
def scripted_dir(tmp_path_factory, smol_tokenizer):
    def last_token(text: str) -> int:
        return smol_tokenizer.encode(text, add_special_tokens=False)[-1]

    replies = {
        last_token("<|im_start|>assistant\n"): TOOL_CALL,
        last_token("<|im_start|>assistant\nResult:"): ANSWER,
    }
    return tiny_models.build_scripted(tmp_path_factory.mktemp("scripted"), smol_tokenizer, replies)


@pytest.fixture(scope="session")
def codex_dir(tmp_path_factory, smol_tokenizer):
    def last_token(text: str) -> int:
        return smol_tokenizer.encode(text, add_special_tokens=False)[-1]

    replies = {
        last_token("<|im_start|>assistant\n"): CODEX_TOOL_CALL,
        last_token("<|im_start|>assistant\nResult:"): ANSWER,
    }
    return tiny_models.build_scripted(
        tmp_path_factory.mktemp("codex"), smol_tokenizer, replies, context=CODEX_CONTEXT
    )


def tiny_model(source: Path) -> str:
    """The catalogue entry of `tiny`: random weights, a 256-token context, 8 tokens unless told, alias `default`."""
    return f"""
[[models]]
id = "tiny"
source = "{source}"
aliases = ["default"]
dtype = "float32"
slots = 4
max_model_len = 256
default_max_tokens = 8
"""


def scripted_model(model_id: str, source: Path, *, context: int = 32768, extra: str = "") -> str:
    """The catalogue entry of a scripted model (tests/tiny_models.build_scripted) under SCRIPTED_TEMPLATE."""
    template = SCRIPTED_TEMPLATE.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f"""
[[models]]
id = "{model_id}"
source = "{source}"
dtype = "float32"
slots = 2
max_model_len = {context}
chat_template = "{template}"
{extra}"""


@pytest.fixture(scope="session")
def clients_stack(tmp_path_factory, tiny_dirs, scripted_dir, codex_dir) -> Iterator[Stack]:
    tiny = tiny_dirs["llama"]
    toml = (
        tiny_model(tiny)
        + f"""
[[models]]
id = "tiny-strict"
source = "{tiny}"
dtype = "float32"
slots = 4
max_model_len = 256
max_tokens_policy = "reject"
"""
        + scripted_model("scripted", scripted_dir)
        + scripted_model("codex", codex_dir, extra='tool_parser = "llama3_json"\n')
    )
    models = ["tiny", "tiny-strict", "scripted", "codex"]
    with serving(tmp_path_factory.mktemp("clients"), toml, "node-c", models) as stack:
        yield stack


stack = checked("clients_stack")


@pytest.fixture
def openai_client(stack: Stack):
    import openai

    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0)


OLLAMA_ADMIN_KEY = "ollama-admin-key"


@dataclass
class KeyedStack:
    stack: Stack
    key: str  # an API key: with one in Redis, every request must carry one

    @property
    def url(self) -> str:
        return self.stack.gateway_url

    @property
    def bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture(scope="session")
def ollama_embedder(tmp_path_factory) -> Path:
    """A tiny BERT embedder (mean pooling + Normalize, as all-MiniLM-L6-v2) for Ollama's `embed`."""
    return tiny_poolers.build_embedder(tmp_path_factory.mktemp("ollama-embed") / "embed")


@pytest.fixture(scope="session")
def ollama_stack(
    tmp_path_factory, tiny_dirs, scripted_dir, ollama_embedder
) -> Iterator[KeyedStack]:
    """`tiny` (alias `default`), `scripted` and the embedder `embed`, behind an API key (made through
    the admin API), for Ollama's clients: its own stack, as a key turns auth on for good."""
    toml = (
        tiny_model(tiny_dirs["llama"])
        + scripted_model("scripted", scripted_dir, context=4096)
        + f'\n[[models]]\nid = "embed"\nkind = "embedding"\nsource = "{ollama_embedder}"\ndtype = "float32"\n'
        "max_model_len = 128\n"
    )
    with serving(
        tmp_path_factory.mktemp("ollama"),
        toml,
        "node-o",
        ["tiny", "scripted", "embed"],
        CORTEX_ADMIN_KEY=OLLAMA_ADMIN_KEY,
    ) as stack:
        created = httpx.post(
            f"{stack.gateway_url}/admin/keys",
            json={"name": "ollama-client"},
            headers={"Authorization": f"Bearer {OLLAMA_ADMIN_KEY}"},
            timeout=30,
        )
        assert created.status_code == 200, created.text
        yield KeyedStack(stack, created.json()["secret"])


@pytest.fixture
def keyed_stack(ollama_stack: KeyedStack) -> Iterator[KeyedStack]:
    """The keyed stack, checked afterwards for pending entries and stray keys."""
    yield ollama_stack
    ollama_stack.stack.assert_clean()


def unknown_fields(log: Path, since_line: int, types: set[str]) -> list[str]:
    """The fields of `types` the gateway logged as unknown after line `since_line` of its `log`."""
    lines = log.read_text().splitlines()[since_line:]
    fields = [
        line.split("ignoring unknown field ")[1].split(" ")[0]
        for line in lines
        if "ignoring unknown field" in line
    ]
    return [field for field in fields if field.split(".")[0] in types]
