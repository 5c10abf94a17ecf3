"""The architecture matrix: every architecture the loader admits (node_agent/architectures.py),
as a tiny random model, decodes greedily token for token what plain full forwards without a cache
decode, under continuous batching with chunked prefill: prompts of different lengths (longer than
the sliding windows, several chunks each) joining a running batch at different steps, more jobs
than slots (rows are reused and packed), through the eager decoder and the padded static one.
Any other architecture is refused at load."""

import json

import pytest

from node_agent import architectures, loader, prompts
from node_agent.engine import Engine
from shared.model_files import ModelLoadError
from tests import tiny_models
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import PROMPTS, full_forward_greedy, request, run

MATRIX = sorted(tiny_models.ARCHITECTURES)
REQUESTS = [request(f"j{i}", f"{p} {p}", temperature=0, max_tokens=6 + i, ignore_eos=True)  # prompts of 36-52 tokens
            for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def references(small_vocab_dirs):
    """Per architecture: its profile, the loaded model and each job's full-forward greedy tokens."""
    loaded = {}

    def get(arch):
        if arch not in loaded:
            profile = tiny_profile(small_vocab_dirs[arch], prefill_chunk_tokens=16, slots=4)
            lm = loader.load(profile, "cpu")
            expected = {r.job: full_forward_greedy(lm, prompts.prompt_ids(lm.tokenizer, profile, r), r.sampling.max_tokens)
                        for r in REQUESTS}
            loaded[arch] = profile, lm, expected
        return loaded[arch]
    return get


def test_the_matrix_is_what_the_loader_admits():
    assert set(MATRIX) == set(architectures.ATTENTION)


@pytest.mark.parametrize("decode", ["eager", "static"])  # static: rows padded to buckets, as on a GPU
@pytest.mark.parametrize("arch", MATRIX)
def test_batched_chunked_greedy_equals_full_forward_greedy(references, arch, decode):
    profile, lm, expected = references(arch)
    assert len({token for ids in expected.values() for token in ids}) > 8  # a model repeating a token tests little
    results = run(Engine(lm, profile.model_copy(update={"decode": decode})), *REQUESTS, join_every=2)
    assert {job: r.token_ids[0] for job, r in results.items()} == expected


def test_an_architecture_outside_the_matrix_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not among.*tested.*gemma2.*qwen3_5_text"):
        loader.load(tiny_profile(tmp_path), "cpu")
