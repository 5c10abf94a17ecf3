"""The architecture matrix: every architecture the loader admits (node_agent/model/architectures.py),
as a tiny random model, decodes greedily token for token what plain full forwards without a cache
decode, under continuous batching with chunked prefill: prompts of different lengths (longer than
the sliding windows, several chunks each) joining a running batch at different steps, more jobs
than slots (rows are reused and packed), through the eager decoder and the padded static one; the
logprobs it reports are the model's own head's (scaled, soft-capped).
Any other architecture is refused at load."""

import json

import pytest
import torch

from node_agent.engine.engine import Engine
from node_agent.model import architectures, compiled_step, loader
from node_agent.serving import prompts
from shared.model_files import ModelLoadError
from tests import tiny_models
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import PROMPTS, full_forward_greedy, request, run

MATRIX = sorted(tiny_models.ARCHITECTURES)
REQUESTS = [
    request(f"j{i}", f"{p} {p}", temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=True)
    for i, p in enumerate(PROMPTS)
]  # prompts of 36-52 tokens


def model_logprobs(lm, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """The logprob of each of `tokens` after `prompt_ids` by one full forward, as the model's own
    head gives it (scaled, soft-capped)."""
    ids = torch.tensor([prompt_ids + tokens])
    with torch.inference_mode():
        logprobs = (
            lm.model(ids, use_cache=False)
            .logits[0, len(prompt_ids) - 1 : -1]
            .float()
            .log_softmax(-1)
        )
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def references(small_vocab_dirs):
    """Per architecture: its profile, the loaded model, and each job's full-forward greedy tokens
    and their logprobs."""
    loaded = {}

    def get(arch):
        if arch not in loaded:
            profile = tiny_profile(small_vocab_dirs[arch], prefill_chunk_tokens=16, slots=4)
            lm = loader.load(profile, "cpu")
            expected = {}
            for r in REQUESTS:
                ids = prompts.prompt_ids(lm.tokenizer, profile, r)
                tokens = full_forward_greedy(lm, ids, r.sampling.max_tokens)
                expected[r.job] = tokens, model_logprobs(lm, ids, tokens)
            loaded[arch] = profile, lm, expected
        return loaded[arch]

    return get


def test_the_matrix_is_what_the_loader_admits():
    assert set(MATRIX) == set(architectures.ATTENTION)


def speculating(profile, method: str = "ngram"):
    """The profile with speculation on for every batch size."""
    return profile.model_copy(
        update={
            "speculative": method,
            "num_speculative_tokens": 4,
            "speculative_max_batch": profile.slots,
        }
    )


def check_speculated(engine: Engine) -> None:
    """Speculation ran where the model allows it (never with linear attention, whose state keeps no guess back)."""
    stats = engine.spec_stats()
    assert (stats.drafts > 0) != engine.cache.has_linear_attention
    assert stats.accepted_tokens <= stats.draft_tokens


# static: rows padded to buckets, as on a GPU; ngram: speculation, whose steps score several tokens a row;
# compiled: a CPU's decode step compiled ahead of time (node_agent/model/compiled_step.py), or eager where it cannot be
@pytest.mark.parametrize(
    "decode, speculative",
    [("eager", "off"), ("static", "off"), ("static", "ngram"), ("compiled", "off")],
)
@pytest.mark.parametrize("arch", MATRIX)
def test_batched_chunked_greedy_equals_full_forward_greedy(references, arch, decode, speculative):
    profile, lm, expected = references(arch)
    assert (
        len({token for tokens, _ in expected.values() for token in tokens}) > 8
    )  # one token repeated tests little
    profile = profile.model_copy(update={"decode": decode})
    engine = Engine(lm, speculating(profile) if speculative == "ngram" else profile)
    results = run(engine, *REQUESTS, join_every=2)
    assert {job: r.token_ids[0] for job, r in results.items()} == {
        job: tokens for job, (tokens, _) in expected.items()
    }
    for job, (_, logprobs) in expected.items():
        assert [entry.logprob for entry in results[job].logprobs[0]] == pytest.approx(
            logprobs, abs=1e-3
        )
    if speculative == "ngram":
        check_speculated(engine)
    if (
        decode == "compiled"
    ):  # compiled wherever the model allows it (else eager, for the reason logged)
        assert (engine.decoder.name == "compiled") == (
            compiled_step.why_not(lm.model, engine.cache) is None
        )


@pytest.mark.parametrize("arch", MATRIX)
def test_speculation_keeps_greedy_output_through_prefix_hits_and_preemption(references, arch):
    """Speculating from recent outputs ("suffix") in a cache of two sequences' worth of blocks:
    sequences are preempted and recomputed, a prompt sent again finds its prefix cached and its
    reply among the recent outputs (long drafts accepted), draft blocks come and go; every job's
    tokens stay those of the engine without speculation or pressure."""
    profile, lm, _ = references(arch)
    first, again = (
        [
            r.model_copy(
                update={
                    "job": r.job + suffix,
                    "sampling": r.sampling.model_copy(update={"max_tokens": 40}),
                }
            )
            for r in REQUESTS
        ]
        for suffix in ("", "-again")
    )
    unpressured = run(Engine(lm, profile), *first, *again, join_every=1)
    engine = Engine(lm, speculating(profile, "suffix"))
    engine.pool.__init__(2 * -(-(52 + 40) // profile.block_size) + 1, profile.block_size)
    results = run(engine, *first, join_every=1) | run(
        engine, *reversed(again), join_every=1
    )  # the last cached first
    assert {job: r.token_ids[0] for job, r in results.items()} == {
        job: r.token_ids[0] for job, r in unpressured.items()
    }
    assert engine.kv_stats().preemptions > 0 and engine.pool.used == 0
    assert (engine.kv_stats().prefix_hits > 0) != engine.cache.has_linear_attention
    check_speculated(engine)
    if not engine.cache.has_linear_attention:  # each reply sent again is guessed from the first
        assert (
            engine.spec_stats().accepted_tokens >= len(REQUESTS) * 20
        )  # of 39 a reply, at most 4 a step


def test_an_architecture_outside_the_matrix_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(
        ModelLoadError, match="model_type 'gpt2' is not among.*tested.*gemma2.*qwen3_5_text"
    ):
        loader.load(tiny_profile(tmp_path), "cpu")
