"""The embedding and rerank engine on tiny random models: what it pools equals a reference computed
here with transformers one input at a time (no padding), whatever the passes it ran them in."""

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from node_agent.engine.pooler import PoolingEngine
from node_agent.model import pooling
from node_agent.serving.pooling_inputs import encode
from shared.catalog import ModelProfile
from shared.errors import ContextLengthExceeded, InvalidRequest
from shared.wire import PoolingRequest
from tests import tiny_poolers

TEXTS = ["The capital of France is Paris.", "Hello there!", "Write a poem about the sea and the sky, please",
         "1 2 3", "Tell me about transformers and attention in detail please. " * 3, "sea"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("poolers")
    return {
        "mean": tiny_poolers.build_embedder(root / "mean"),
        "cls": tiny_poolers.build_embedder(root / "cls", pooling="cls_token", normalize=False),
        "last": tiny_poolers.build_embedder(root / "last", pooling="lasttoken", decoder=True),
        "rerank": tiny_poolers.build_cross_encoder(root / "rerank"),
    }


def engine(folder, kind: str = "embedding", **profile) -> PoolingEngine:
    prof = ModelProfile(**dict(id=folder.name, source=str(folder), kind=kind, dtype="float32", max_model_len=64) | profile)
    return PoolingEngine(pooling.load(prof, "cpu"), prof)


def run(eng: PoolingEngine, request: PoolingRequest):
    eng.add(request.job, encode(eng.lm, request), request.dimensions, 0.0)
    done = []
    while eng.has_work:
        done += eng.core_step().done
    assert [d.job for d in done] == [request.job]
    return done[0]


def vectors(pooled) -> np.ndarray:
    return np.stack([np.frombuffer(v, dtype="<f4") for v in pooled.vectors])


@torch.inference_mode()
def reference(folder, texts: list[str], mode: str, normalize: bool) -> np.ndarray:
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    rows = []
    for text in texts:
        hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        vector = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[mode]
        rows.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return torch.stack(rows).numpy()


@pytest.mark.parametrize("mode,normalize", [("mean", True), ("cls", False), ("last", True)])
def test_vectors_equal_one_input_at_a_time(folders, mode, normalize):
    eng = engine(folders[mode], pooling_batch_tokens=64)  # several passes, each padded to its longest row
    done = run(eng, PoolingRequest(job="j", model="m", kind="embed", inputs=TEXTS))
    got = vectors(done.pooled)
    np.testing.assert_allclose(got, reference(folders[mode], TEXTS, mode, normalize), atol=1e-5)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert 1 < done.pooled.forwards == eng.forwards < len(TEXTS)
    assert done.prompt_tokens == sum(len(AutoTokenizer.from_pretrained(folders[mode])(t)["input_ids"]) for t in TEXTS)


def test_many_inputs_take_few_passes(folders):
    eng = engine(folders["mean"])  # the default budget of 16,384 tokens
    inputs = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(256)]
    done = run(eng, PoolingRequest(job="j", model="m", kind="embed", inputs=inputs))
    assert done.pooled.forwards == 1 and len(done.pooled.vectors) == 256


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
    full = vectors(run(eng, PoolingRequest(job="a", model="m", kind="embed", inputs=TEXTS[:2])).pooled)
    cut = vectors(run(eng, PoolingRequest(job="b", model="m", kind="embed", inputs=TEXTS[:2], dimensions=16)).pooled)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    with pytest.raises(InvalidRequest, match="dimensions must be between 1 and the model's 64"):
        encode(eng.lm, PoolingRequest(job="c", model="m", kind="embed", inputs=["x"], dimensions=65))


def test_long_inputs_are_refused_unless_truncated(folders):
    eng = engine(folders["mean"], max_model_len=16)
    long = PoolingRequest(job="a", model="m", kind="embed", inputs=["short", TEXTS[4]])
    with pytest.raises(ContextLengthExceeded, match="input 1 has .* tokens; this model takes at most 16"):
        encode(eng.lm, long)
    assert [len(row) for row in encode(eng.lm, long.model_copy(update={"truncate": True})).rows][1] == 16


@torch.inference_mode()
def test_rerank_scores_are_the_heads_logits(folders):
    eng = engine(folders["rerank"], kind="rerank", pooling_batch_tokens=48)
    query, documents = "What is the capital of France?", TEXTS
    done = run(eng, PoolingRequest(job="j", model="m", kind="rerank", inputs=documents, query=query))
    tokenizer = AutoTokenizer.from_pretrained(folders["rerank"])
    model = AutoModelForSequenceClassification.from_pretrained(folders["rerank"]).eval()
    expected = [model(**tokenizer(query, doc, return_tensors="pt")).logits[0, 0].item() for doc in documents]
    np.testing.assert_allclose(done.pooled.scores, expected, atol=1e-5)
    assert done.pooled.forwards > 1


def test_cancel_drops_a_jobs_waiting_inputs(folders):
    eng = engine(folders["mean"], pooling_batch_tokens=16)
    eng.add("a", encode(eng.lm, PoolingRequest(job="a", model="m", kind="embed", inputs=TEXTS)), None, 0.0)
    eng.add("b", encode(eng.lm, PoolingRequest(job="b", model="m", kind="embed", inputs=["sea"])), None, 0.0)
    eng.cancel("a")
    assert [d.job for d in eng.core_step().done] == ["b"] and not eng.has_work
