"""A hub on loopback (tests/hub_server.py, its own process) serving a tiny model, and node agents
that pull from it into their own models directories."""

import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.model_store import MANIFEST, WORK_DIR
from shared.processes import free_port
from tests import hub_server
from tests.conftest import Service
from tests.stack import Stack

REPO = "org/tiny"
FOLDER = "org--tiny"


class LoopbackHub:
    def __init__(self, root: Path):
        self.root, self.port, self.log = root, free_port(), root / "requests.log"
        self.root.mkdir(parents=True, exist_ok=True)
        self.service: Service | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def publish(self, repo: str, folder: Path) -> dict:
        return hub_server.publish(self.root / "repos", repo, folder)

    def start(self, throttle_bps: int = 0, token: str = "") -> None:
        args = [
            sys.executable,
            "-m",
            "tests.hub_server",
            "--root",
            str(self.root / "repos"),
            "--port",
            str(self.port),
            "--log",
            str(self.log),
            "--throttle-bps",
            str(throttle_bps),
            "--token",
            token,
        ]
        self.service = Service("hub", args, self.root / "hub.log")
        self.service.wait_ready(
            lambda: socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close() is None
        )

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None

    def requests(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def hub(tmp_path) -> Iterator[LoopbackHub]:
    served = LoopbackHub(tmp_path / "hub")
    yield served
    served.stop()


@pytest.fixture(scope="session")
def tiny_repo(small_vocab_dirs, tmp_path_factory) -> Path:
    """A tiny Llama's files as a hub repo holds them, with files a model does not need beside them
    (a README, the same weights as a PyTorch .bin)."""
    folder = tmp_path_factory.mktemp("repo") / "tiny"
    shutil.copytree(small_vocab_dirs["llama"], folder)
    (folder / "README.md").write_text("# tiny\n")
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    return folder


NEEDED = sorted(
    [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
)


def catalogue(**models: str) -> str:
    """models.toml: id -> source (and `nodes = [...]` after a `|`)."""
    blocks = []
    for model_id, spec in models.items():
        source, _, nodes = spec.partition("|")
        allowed = f"nodes = {json.dumps(nodes.split(','))}\n" if nodes else ""
        blocks.append(
            f'[[models]]\nid = "{model_id}"\nsource = "{source}"\ndtype = "float32"\nslots = 2\n'
            f"max_model_len = 128\nmemory_mb = 100\n{allowed}"
        )
    return "\n".join(blocks)


def node_env(tmp_path: Path, name: str, hub: LoopbackHub, **extra: str) -> dict[str, str]:
    """A node pulling from `hub` into its own models directory, with an empty Hugging Face cache."""
    return {
        "CORTEX_MODELS_DIR": str(tmp_path / f"models-{name}"),
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(tmp_path / f"hf-cache-{name}"),
        "HF_HUB_OFFLINE": "0",
        "CORTEX_HEARTBEAT_S": "0.5",
    } | extra


def folder_files(models_dir: Path, folder: str = FOLDER) -> list[str]:
    """The model files a folder holds (not the manifest, the last-use mark or the work files)."""
    root = models_dir / folder
    return (
        sorted(p.name for p in root.iterdir() if p.is_file() and not p.name.startswith("cortex-"))
        if root.is_dir()
        else []
    )


def complete(models_dir: Path, folder: str = FOLDER) -> bool:
    return (models_dir / folder / MANIFEST).is_file()


def partial_bytes(models_dir: Path, folder: str = FOLDER) -> int:
    return sum(p.stat().st_size for p in (models_dir / folder / WORK_DIR).rglob("*.partial"))


def send(stack: Stack, node: str, cmd: str, model: str) -> None:
    stack.client().xadd(
        stack.keys.cmd(node), {"cmd": cmd, "model": model, "by": "test", "sent_ms": 0}
    )


def pulls(stack: Stack, node: str) -> dict[str, dict]:
    return json.loads(stack.client().hget(stack.keys.node(node), "pulls") or b"{}")


def cortex(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    """The `cortex` CLI against the stack's Redis, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        env=stack.env | {"COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
