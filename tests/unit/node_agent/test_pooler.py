"""The embedding and rerank engine on tiny random models: what it pools equals a reference computed
here with transformers one input at a time (no padding), whatever the passes it ran them in."""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from node_agent.engine.pooler import Encoded, PoolingEngine
from node_agent.model import pooling
from node_agent.serving.pooling_inputs import encode
from shared.catalog import ModelProfile
from shared.errors import ContextLengthExceeded, InvalidRequest
from shared.model_files import ModelLoadError
from shared.wire import PoolingRequest
from tests import tiny_poolers

TEXTS = [
    "The capital of France is Paris.",
    "Hello there!",
    "Write a poem about the sea and the sky, please",
    "1 2 3",
    "Tell me about transformers and attention in detail please. " * 3,
    "sea",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("poolers")
    return {
        "mean": tiny_poolers.build_embedder(root / "mean"),
        "cls": tiny_poolers.build_embedder(root / "cls", pooling="cls_token", normalize=False),
        "last": tiny_poolers.build_embedder(root / "last", pooling="lasttoken", decoder=True),
        "rerank": tiny_poolers.build_cross_encoder(root / "rerank"),
    }


def engine(folder, kind: str = "embedding", pack: bool = True, **profile) -> PoolingEngine:
    prof = ModelProfile(
        **dict(id=folder.name, source=str(folder), kind=kind, dtype="float32", max_model_len=64)
        | profile
    )
    return PoolingEngine(pooling.load(prof, "cpu"), prof, pack=pack)


def run(eng: PoolingEngine, request: PoolingRequest):
    eng.add(request.job, encode(eng.lm, request), request.dimensions, 0.0)
    done = []
    while eng.has_work:
        done += eng.core_step().done
    assert [d.job for d in done] == [request.job]
    return done[0]


def vectors(pooled) -> np.ndarray:
    return np.stack([np.frombuffer(v, dtype="<f4") for v in pooled.vectors])


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("mode,normalize", [("mean", True), ("cls", False), ("last", True)])
def test_vectors_equal_one_input_at_a_time(folders, mode, normalize, pack):
    eng = engine(folders[mode], pack=pack, pooling_batch_tokens=24)  # several passes
    assert eng.packed == pack  # BERT and Qwen3 both pack on a CPU
    done = run(eng, PoolingRequest(job="j", model="m", kind="embed", inputs=TEXTS))
    got = vectors(done.pooled)
    np.testing.assert_allclose(
        got, tiny_poolers.reference_vectors(folders[mode], TEXTS, mode, normalize), atol=1e-5
    )
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert 1 < done.pooled.forwards == eng.forwards <= len(TEXTS)
    assert done.prompt_tokens == sum(
        len(AutoTokenizer.from_pretrained(folders[mode])(t)["input_ids"]) for t in TEXTS
    )


def test_many_inputs_take_few_passes(folders):
    inputs = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(256)]  # 3,102 tokens, up to 41 an input
    request = PoolingRequest(job="j", model="m", kind="embed", inputs=inputs)
    packed = run(engine(folders["mean"]), request)  # the default budget of 8,192 tokens
    assert packed.pooled.forwards == 1 and len(packed.pooled.vectors) == 256
    some = [0, 4, 100, 254, 255]  # in a packed row far longer than the model's 128 positions
    np.testing.assert_allclose(
        vectors(packed.pooled)[some],
        tiny_poolers.reference_vectors(folders["mean"], [inputs[i] for i in some]),
        atol=1e-5,
    )
    # padded: the longest rows first, each pass padded to its longest
    assert run(engine(folders["mean"], pack=False), request).pooled.forwards == 2
    assert (
        run(
            engine(folders["mean"], pack=False, pooling_batch_tokens=256 * 41), request
        ).pooled.forwards
        == 1
    )


def test_token_ids_are_the_models_own(folders):
    eng = engine(folders["mean"])
    ids = AutoTokenizer.from_pretrained(folders["mean"])(TEXTS[0])["input_ids"]
    by_text = run(eng, PoolingRequest(job="a", model="m", kind="embed", inputs=[TEXTS[0]]))
    by_ids = run(eng, PoolingRequest(job="b", model="m", kind="embed", inputs=[ids]))
    assert by_ids.pooled.vectors == by_text.pooled.vectors
    with pytest.raises(InvalidRequest, match="outside this model's vocabulary"):
        encode(eng.lm, PoolingRequest(job="c", model="m", kind="embed", inputs=[[100_000]]))


def test_dimensions_keep_the_leading_ones_renormalised(folders):
    eng = engine(folders["mean"])
    full = vectors(
        run(eng, PoolingRequest(job="a", model="m", kind="embed", inputs=TEXTS[:2])).pooled
    )
    cut = vectors(
        run(
            eng, PoolingRequest(job="b", model="m", kind="embed", inputs=TEXTS[:2], dimensions=16)
        ).pooled
    )
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    with pytest.raises(InvalidRequest, match="dimensions must be between 1 and the model's 64"):
        encode(
            eng.lm, PoolingRequest(job="c", model="m", kind="embed", inputs=["x"], dimensions=65)
        )


def test_long_inputs_are_refused_unless_truncated(folders):
    eng = engine(folders["mean"], max_model_len=16)
    long = PoolingRequest(job="a", model="m", kind="embed", inputs=["short", TEXTS[4]])
    with pytest.raises(
        ContextLengthExceeded, match="input 1 has .* tokens; this model takes at most 16"
    ):
        encode(eng.lm, long)
    assert [len(row) for row in encode(eng.lm, long.model_copy(update={"truncate": True})).rows][
        1
    ] == 16


def test_rerank_scores_are_the_heads_logits_through_its_activation(folders, tmp_path):
    query, documents = "What is the capital of France?", TEXTS
    rerank = PoolingRequest(
        job="j", model="m", kind="rerank", inputs=documents, queries=[query] * len(documents)
    )
    done = run(engine(folders["rerank"], kind="rerank", pooling_batch_tokens=48), rerank)
    raw = tiny_poolers.reference_logits(folders["rerank"], query, documents)
    np.testing.assert_allclose(
        done.pooled.scores, torch.sigmoid(raw).numpy(), atol=1e-6
    )  # a one-label head's default
    assert done.pooled.forwards > 1
    identity = tiny_poolers.build_cross_encoder(
        tmp_path / "identity", activation="torch.nn.modules.linear.Identity"
    )
    np.testing.assert_allclose(
        run(engine(identity, kind="rerank"), rerank).pooled.scores, raw.numpy(), atol=1e-5
    )


def test_cancel_drops_a_jobs_waiting_inputs(folders):
    eng = engine(folders["mean"], pooling_batch_tokens=16)
    eng.add(
        "a",
        encode(eng.lm, PoolingRequest(job="a", model="m", kind="embed", inputs=TEXTS)),
        None,
        0.0,
    )
    eng.add(
        "b",
        encode(eng.lm, PoolingRequest(job="b", model="m", kind="embed", inputs=["sea"])),
        None,
        0.0,
    )
    eng.cancel("a")
    assert [d.job for d in eng.core_step().done] == ["b"] and not eng.has_work


def test_a_rerank_model_needs_a_one_label_head(tmp_path):
    folder = tiny_poolers.build_embedder(
        tmp_path / "two"
    )  # reloaded as a classifier: a fresh two-label head
    profile = ModelProfile(id="two", source=str(folder), kind="rerank", dtype="float32")
    with pytest.raises(ModelLoadError, match="a rerank model needs a one-label head; it has 2"):
        pooling.load(profile, "cpu")


def test_an_input_without_tokens_is_refused_before_the_device(folders):
    eng = engine(
        folders["last"]
    )  # the byte-level tokenizer adds no special tokens: "" is no token at all
    with pytest.raises(InvalidRequest, match="input 1 has no tokens for this model"):
        encode(eng.lm, PoolingRequest(job="j", model="m", kind="embed", inputs=["sea", ""]))


def test_jobs_asking_different_dimensions_share_a_pass(folders):
    eng = engine(folders["mean"])
    eng.add(
        "full",
        encode(eng.lm, PoolingRequest(job="full", model="m", kind="embed", inputs=TEXTS[:2])),
        None,
        0.0,
    )
    eng.add(
        "cut",
        encode(eng.lm, PoolingRequest(job="cut", model="m", kind="embed", inputs=TEXTS[:2])),
        8,
        0.0,
    )
    done = {d.job: vectors(d.pooled) for d in eng.core_step().done}
    assert eng.forwards == 1 and done["full"].shape == (2, 64) and done["cut"].shape == (2, 8)
    np.testing.assert_allclose(
        done["cut"],
        done["full"][:, :8] / np.linalg.norm(done["full"][:, :8], axis=1, keepdims=True),
        atol=1e-6,
    )


def test_a_step_after_its_only_job_was_cancelled_does_nothing(folders):
    """The device thread may step an engine whose last waiting job a cancel (queued work, run between
    two steps) just dropped: the step finds nothing to run, rather than failing."""
    eng = engine(folders["mean"])
    request = PoolingRequest(job="j", model="m", kind="embed", inputs=TEXTS)
    eng.add(request.job, encode(eng.lm, request), None, 0.0)
    eng.cancel("j")
    assert eng.core_step().done == [] and not eng.has_work


def test_the_engine_answers_what_serving_asks_of_its_device(folders):
    eng = engine(folders["mean"])
    assert eng.is_device_fault(torch.OutOfMemoryError("out of memory")) and not eng.is_device_fault(
        ValueError("x")
    )
    eng.free()
    assert eng.lm.model is None


def test_inputs_times_dimensions_are_capped_with_a_clear_400(folders):
    """2048 inputs on a 4096-wide model would be a 32 MB result: a node refuses more floats than
    `max_pooled_floats` before any forward pass (here 64 inputs × 64 dimensions fit, 65 do not)."""
    eng = engine(folders["mean"])
    fits = PoolingRequest(job="a", model="m", kind="embed", inputs=["x"] * 64)
    assert len(encode(eng.lm, fits, max_floats=64 * 64).rows) == 64
    over = fits.model_copy(update={"inputs": ["x"] * 65})
    with pytest.raises(InvalidRequest, match="65 inputs × 64 dimensions .*at most 4096 floats"):
        encode(eng.lm, over, max_floats=64 * 64)
    cut = over.model_copy(update={"dimensions": 32})  # fewer dimensions: more inputs fit
    assert len(encode(eng.lm, cut, max_floats=64 * 64).rows) == 65


class CountedId(str):
    """A job id that counts how often it is hashed: each time a pass looks at one of its inputs."""

    hashes = 0

    def __hash__(self) -> int:
        CountedId.hashes += 1
        return super().__hash__()


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_a_pass_looks_at_its_own_inputs_not_the_whole_queue(folders, pack):
    """Behind 20,000 waiting inputs, a pass of a few looks at a few (it rescanned the whole queue)."""
    eng = engine(folders["mean"], pack=pack, pooling_batch_tokens=16)
    (row,) = encode(eng.lm, PoolingRequest(job="q", model="m", kind="embed", inputs=["x"])).rows
    job = CountedId("queue")
    eng.add(job, Encoded([row] * 20_000), None, 0.0)
    CountedId.hashes = 0
    for _ in range(5):
        eng.core_step()
    assert CountedId.hashes < 500, f"{CountedId.hashes} looks at waiting inputs in 5 passes"


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_a_pass_beside_another_model_is_cut_to_its_time_bound(folders, pack, monkeypatch):
    """Sharing its device, a pass takes what fits `pooling_pass_ms` at the last pass's speed (another
    model's steps wait no longer between passes); alone, its whole budget. The passes' time is a
    clock here, a millisecond per token computed (padding included), so the sizes are exact."""
    from node_agent.engine import pooler

    now = [0.0]

    def timed(real):
        def run_pass(lm, rows, *rest):
            lengths = [len(r) for r in rows]
            now[0] += (sum(lengths) if pack else max(lengths) * len(lengths)) / 1000
            return real(lm, rows, *rest)

        return run_pass

    forward, packed_forward = pooler.pooling.forward, pooler.packed_pooling.forward
    monkeypatch.setattr(pooler.pooling, "forward", timed(forward))
    monkeypatch.setattr(pooler.packed_pooling, "forward", timed(packed_forward))
    monkeypatch.setattr(pooler.time, "perf_counter", lambda: now[0])
    eng = engine(folders["mean"], pack=pack, pooling_batch_tokens=400, pooling_pass_ms=50)
    (row,) = encode(eng.lm, PoolingRequest(job="q", model="m", kind="embed", inputs=["x y"])).rows

    def pass_sizes(job: str, passes: int | None = None) -> list[int]:
        """The tokens of each pass over 200 inputs of `job` (all of them, or the first `passes`)."""
        eng.add(job, Encoded([row] * 200), None, 0.0)
        sizes = []
        while eng.has_work and len(sizes) != passes:
            before = now[0]
            eng.core_step()
            sizes.append(round((now[0] - before) * 1000))
        return sizes

    sizes = pass_sizes("alone")
    assert sizes[0] == 400 and max(sizes) <= 400  # the budget's tokens a pass
    eng.shares_device = True
    sizes = pass_sizes("shared")
    assert max(sizes) <= 50 and sum(sizes) == 200 * len(row), sizes  # 50 ms: 50 tokens a pass
    eng.pass_ms = 0  # no bound
    assert pass_sizes("unbounded", passes=1) == [400]
