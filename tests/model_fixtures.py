"""Fixtures that build models: the default model's tokenizer and tiny random-weight models."""

from pathlib import Path

import pytest

from node_agent.model import loader
from shared import model_files
from shared.catalog import Catalog, ModelProfile
from tests import tiny_models


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The default model's tokenizer, read from its GGUF."""
    from transformers import AutoTokenizer

    files = model_files.locate(Catalog.load(None).resolve("default"))
    return AutoTokenizer.from_pretrained(files.folder, gguf_file=files.gguf_file)


class TinyDirs(dict):
    """Folders of tiny random models by architecture (tests/tiny_models.py), each built on first use."""

    def __init__(self, root: Path, tokenizer):
        super().__init__()
        self.root, self.tokenizer = root, tokenizer

    def __missing__(self, arch: str) -> Path:
        self[arch] = tiny_models.build(arch, self.root / arch, self.tokenizer)
        return self[arch]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, smol_tokenizer) -> TinyDirs:
    """With the default model's tokenizer (its chat template, a 49k vocabulary)."""
    return TinyDirs(tmp_path_factory.mktemp("tiny"), smol_tokenizer)


@pytest.fixture(scope="session")
def small_vocab_dirs(tmp_path_factory) -> TinyDirs:
    """With a byte-level tokenizer of 400 tokens trained here: cheaper forwards (the vocabulary
    dominates a hidden size of 64), and nothing needs the default model installed."""
    return TinyDirs(tmp_path_factory.mktemp("tiny-small-vocab"), tiny_models.make_tokenizer())


def tiny_profile(folder: Path, **overrides) -> ModelProfile:
    return ModelProfile(
        **{
            "id": folder.name,
            "source": str(folder),
            "dtype": "float32",
            "slots": 8,
            "max_model_len": 256,
        }
        | overrides
    )


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs):
    profile = tiny_profile(tiny_dirs["llama"])
    return profile, loader.load(profile, "cpu")


@pytest.fixture(scope="session")
def tiny_vision_dirs(tmp_path_factory, smol_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-vision")
    return {
        arch: tiny_models.build_vision(arch, root / arch, smol_tokenizer)
        for arch in tiny_models.VISION_ARCHITECTURES
    }


@pytest.fixture(scope="session", params=sorted(tiny_models.VISION_ARCHITECTURES))
def tiny_vision(request, tiny_vision_dirs):
    """Each tiny vision model, loaded (prefill chunks of 16 tokens: boundaries fall inside images)."""
    profile = tiny_profile(tiny_vision_dirs[request.param], vision=True, prefill_chunk_tokens=16)
    return profile, loader.load(profile, "cpu")
