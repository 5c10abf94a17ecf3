"""GPU tier: runs only where CUDA is available (skipped elsewhere, saying so). Needs nothing an
offline GPU host lacks: tiny random models with a tokenizer trained at test time."""

import pytest
import torch

from node_agent.model import loader
from tests.model_fixtures import tiny_profile

ARCHS = [
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_5_text",
    "gemma3_text",
]  # full; linear + full; sliding + full


def pytest_collection_modifyitems(items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device here: the GPU tier runs on a GPU host")
        for item in items:
            if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_tiny_dirs(small_vocab_dirs):
    return small_vocab_dirs


def load(folder, **overrides):
    profile = tiny_profile(folder, **overrides)
    return profile, loader.load(profile, "cuda")
