"""Fixtures that build models: the default model's tokenizer and tiny random-weight models."""

from pathlib import Path

import pytest

from node_agent import loader
from shared import model_files
from shared.catalog import Catalog, ModelProfile
from tests import tiny_models


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The default model's tokenizer, read from its GGUF."""
    from transformers import AutoTokenizer

    files = model_files.locate(Catalog.load(None).resolve("default"))
    return AutoTokenizer.from_pretrained(files.folder, gguf_file=files.gguf_file)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, smol_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: tiny_models.build(arch, root / arch, smol_tokenizer) for arch in tiny_models.ARCHITECTURES}


def tiny_profile(folder: Path, **overrides) -> ModelProfile:
    return ModelProfile(**{"id": folder.name, "source": str(folder), "dtype": "float32", "slots": 8,
                           "max_model_len": 256} | overrides)


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs):
    profile = tiny_profile(tiny_dirs["llama"])
    return profile, loader.load(profile, "cpu")
