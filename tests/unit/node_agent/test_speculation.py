"""Speculative decoding (node_agent/engine/speculation.py, node_agent/model/acceptance.py): the
n-gram proposer, recent outputs and draft lengths; on a scripted model that writes a known reply (so drafts taken
from a prompt that quotes it are accepted), stop strings, max_tokens, grammars and logprobs give
what they give without speculation while drafts run across them; on a random model with a
vocabulary of 8, sampled outputs follow the model's own distribution (chi-square)."""

import math
import random

import pytest
import torch

from node_agent.engine.engine import Engine
from node_agent.engine.speculation import SEPARATOR, DraftLength, NgramIndex, RecentOutputs
from node_agent.model import loader
from node_agent.model.decoders import StaticDecoder
from node_agent.model.model_calls import ModelCalls
from tests import tiny_models
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import request, run

REPLY = "The capital of France is Paris, a city on the Seine."


def test_ngram_proposes_what_followed_the_longest_latest_match():
    longest = NgramIndex()
    longest.extend([1, 2, 3, 4, 5, 2, 3, 6, 1, 2, 3])
    assert longest.match(longest.tokens, 2) == (3, [4, 5])  # "1 2 3" matched, not the later "2 3"
    latest = NgramIndex()
    latest.extend([1, 2, 3, 4, 1, 2, 3, 6, 1, 2, 3])
    assert latest.match(latest.tokens, 2) == (3, [6, 1])
    assert latest.match(latest.tokens, 9) == (3, [6, 1, 2, 3])  # what there is
    latest.extend([42])
    assert latest.match(latest.tokens, 4) == (0, [])  # 42 was never seen before


def test_recent_outputs_are_bounded_and_never_guessed_across():
    recent = RecentOutputs(limit=40)
    recent.add([7, 8, 9, 10])
    recent.add([11, 12])
    assert recent.index.match([5, 7, 8], 4) == (
        2,
        [9, 10],
    )  # up to the end of that output, not into the next
    for i in range(10):
        recent.add([100 + i] * 5)
    recent.add([200, 201, 202, 203])
    assert len(recent.index.tokens) <= 40 and recent.index.tokens[-1] == SEPARATOR
    assert recent.index.match([7, 8], 4) == (0, [])  # the oldest were dropped
    assert recent.index.match([3, 200, 201], 4) == (2, [202, 203])


def test_draft_length_follows_acceptance():
    length = DraftLength(limit=8, current=4)
    length.update(drafted=4, accepted=4)
    assert length.current == 6
    length.update(drafted=6, accepted=2)
    assert length.current == 5
    length.update(drafted=0, accepted=0)  # nothing drafted: nothing learnt
    assert length.current == 5
    for _ in range(3):
        length.update(drafted=5, accepted=5)
    assert length.current == 8


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, smol_tokenizer):
    """A model that writes REPLY after the token `trigger`, and a prompt that quotes the reply first."""
    trigger = smol_tokenizer.encode(" Answer:", add_special_tokens=False)[-1]
    folder = tiny_models.build_scripted(
        tmp_path_factory.mktemp("scripted"), smol_tokenizer, {trigger: REPLY}
    )
    profile = tiny_profile(folder, slots=4, max_model_len=512)
    lm = loader.load(profile, "cpu")
    reply = smol_tokenizer.encode(REPLY, add_special_tokens=False)
    return profile, lm, [trigger, *reply, trigger]


def speculative(profile, k: int = 8):
    return profile.model_copy(update={"speculative": "ngram", "num_speculative_tokens": k})


def both(scripted, **sampling):
    """The scripted reply without and with speculation: the results, and the speculating engine."""
    profile, lm, prompt = scripted
    engine = Engine(lm, speculative(profile))
    alone = run(Engine(lm, profile), request("j", prompt, kind="completion", **sampling))["j"]
    return alone, run(engine, request("j", prompt, kind="completion", **sampling))["j"], engine


def test_a_quoted_reply_is_accepted_in_few_steps(scripted):
    profile, lm, prompt = scripted
    engine = Engine(lm, speculative(profile))
    result = run(engine, request("j", prompt, kind="completion", temperature=0, max_tokens=40))["j"]
    assert result.text[0] == REPLY and result.finish[0] == "stop"
    stats = engine.spec_stats()
    assert (
        stats.accepted_tokens >= len(result.token_ids[0]) - 3
    )  # the first token, and the draft length ramping up
    assert result.deltas < len(result.token_ids[0]) / 2  # several tokens a step


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_stop_strings_max_tokens_and_logprobs_are_as_without_speculation(scripted, temperature):
    """A stop string inside a step's accepted draft cuts the text where it would have; max_tokens
    ends within a draft; the logprobs are each kept token's."""
    for sampling in (
        dict(stop=["a city"]),
        dict(max_tokens=7),
        dict(logprobs=True, top_logprobs=2),
    ):
        alone, fast, engine = both(
            scripted, temperature=temperature, seed=3, **({"max_tokens": 40} | sampling)
        )
        assert (fast.text, fast.token_ids, fast.finish) == (
            alone.text,
            alone.token_ids,
            alone.finish,
        )
        assert fast.done.usage == alone.done.usage
        assert logprobs(fast) == logprobs(alone)
        assert engine.spec_stats().accepted_tokens > 0
    assert alone.text[0].startswith("The capital") and len(alone.logprobs[0]) == len(
        alone.token_ids[0]
    )


def logprobs(result) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [
        (e.token, round(e.logprob, 2), [(t.token, round(t.logprob, 2)) for t in e.top_logprobs])
        for e in result.logprobs.get(0, [])
    ]


@pytest.mark.parametrize(
    "method, salt, guessed",
    [("suffix", "", True), ("ngram", "", False), ("suffix", "tenant-b", False)],
)
def test_suffix_guesses_a_reply_that_repeats_an_earlier_one(
    small_vocab_dirs, method, salt, guessed
):
    """A random model's greedy reply shares nothing with its prompt; asked again, "suffix" finds it
    among the model's recent outputs and nearly every guess holds; "ngram" cannot, nor can a job
    with a cache salt (another tenant's outputs are not its to guess from, as its blocks are not)."""
    profile = tiny_profile(small_vocab_dirs["llama"], slots=4)
    lm = loader.load(profile, "cpu")
    ask = dict(kind="completion", temperature=0, max_tokens=24, ignore_eos=True)
    engine = Engine(lm, profile.model_copy(update={"speculative": method}))
    first = run(engine, request("a", "Tell me about the sea", **ask))["a"]
    before = engine.spec_stats().accepted_tokens
    again = run(
        engine, request("b", "Tell me about the sea", **ask).model_copy(update={"cache_salt": salt})
    )["b"]
    assert again.token_ids == first.token_ids
    assert (engine.spec_stats().accepted_tokens - before >= 20) == guessed


def test_a_grammar_cuts_drafts_it_forbids(scripted):
    """The draft quotes the reply ("Paris, a city…"); the grammar allows only "Rome." there: the
    guesses it forbids are never scored, and the output is the grammar's, as without speculation."""
    grammar = 'start: "The capital of France is Rome."'
    alone, fast, engine = both(scripted, temperature=0, max_tokens=40, grammar=grammar)
    assert fast.text == alone.text == {0: "The capital of France is Rome."}
    stats = engine.spec_stats()
    assert (
        0 < stats.accepted_tokens == stats.draft_tokens
    )  # every draft token scored was one the grammar allows


# ---- the distribution of sampled output --------------------------------------------------------------

VOCAB = 8


def chi_square_limit(df: int, z: float = 3.09) -> float:
    """The chi-square value a statistic with `df` degrees of freedom exceeds with probability
    ~0.001 (z: the normal quantile), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow  # samples thousands of tokens to compare distributions (~30 s)
def test_sampled_output_follows_the_model_distribution(tmp_path, smol_tokenizer):
    """2,560 sampled continuations of 3 tokens (the first drawn at the prompt's end, the others
    through drafts accepted or refused) against the probabilities of every triple by full forwards."""
    folder = tiny_models.build(
        "llama",
        tmp_path / "v8",
        tiny_models.make_tokenizer(),
        vocab_size=VOCAB,
        initializer_range=0.05,
    )
    profile = speculative(
        tiny_profile(folder, slots=64, max_model_len=128, speculative_max_batch=64), k=2
    )
    lm = loader.load(profile, "cpu")
    rng = random.Random(0)
    prompt = [
        rng.randrange(VOCAB) for _ in range(48)
    ]  # every token is followed by something: always a draft
    jobs, n = 80, 32
    engine = Engine(lm, profile)
    results = run(
        engine,
        *[
            request(
                f"s{j}",
                prompt,
                kind="completion",
                temperature=1.0,
                max_tokens=3,
                n=n,
                seed=j * n,
                ignore_eos=True,
            )
            for j in range(jobs)
        ],
    )
    counts: dict[tuple[int, ...], int] = {}
    for result in results.values():
        for tokens in result.token_ids.values():
            counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    stats = engine.spec_stats()
    assert 0 < stats.accepted_tokens < stats.draft_tokens and stats.drafts >= jobs * n * 0.9
    with torch.inference_mode():
        pairs = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        probs = (
            lm.model(pairs).logits[:, -3:].float().softmax(-1)
        )  # after the prompt, after a, after a b
    expected = {
        (a, b, c): probs[a * VOCAB + b, 0, a]
        * probs[a * VOCAB + b, 1, b]
        * probs[a * VOCAB + b, 2, c]
        for a in range(VOCAB)
        for b in range(VOCAB)
        for c in range(VOCAB)
    }
    total = jobs * n
    assert sum(counts.values()) == total
    big = [cell for cell, p in expected.items() if p * total >= 5]
    rest = total - sum(counts.get(cell, 0) for cell in big)
    observed = [counts.get(cell, 0) for cell in big] + [rest]
    wanted = [float(expected[cell]) * total for cell in big] + [
        total - sum(float(expected[c]) * total for c in big)
    ]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    assert len(big) > 20  # the test has cells enough to notice a skew
    assert statistic < chi_square_limit(len(observed) - 1), (statistic, len(observed))


def test_the_static_decoders_verify_step_scores_drafts_as_the_padded_forward_does(
    scripted, monkeypatch
):
    """Where a model does not pack decode rows with prefill chunks (a GPU's), drafts are scored by
    the static decoder's verify step (captured in CUDA graphs on a GPU): rows padded to a batch and
    a width bucket. Greedy and sampled tokens equal the eager padded forward's."""
    monkeypatch.setattr(ModelCalls, "packs", property(lambda self: False))
    profile, lm, prompt = scripted
    jobs = [
        request(f"j{i}", prompt, kind="completion", temperature=t, seed=i, max_tokens=30)
        for i, t in enumerate((0, 0, 0.8))
    ]
    eager = Engine(lm, speculative(profile.model_copy(update={"decode": "eager"})))
    static = Engine(lm, speculative(profile.model_copy(update={"decode": "static"})))
    verified, verify = [], StaticDecoder.verify
    monkeypatch.setattr(
        StaticDecoder,
        "verify",
        lambda self, rows, starts: verified.append(rows) or verify(self, rows, starts),
    )
    assert {j: r.token_ids for j, r in run(static, *jobs).items()} == {
        j: r.token_ids for j, r in run(eager, *jobs).items()
    }
    assert verified and static.spec_stats().accepted_tokens > 0
