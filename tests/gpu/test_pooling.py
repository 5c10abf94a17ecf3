"""The embedding and rerank engine on a GPU (padded passes there): vectors and scores equal the
CPU reference (transformers, one input at a time, fp32) within float tolerance."""

import numpy as np
import pytest
import torch

from node_agent.engine.pooler import PoolingEngine
from node_agent.model import pooling
from node_agent.serving.pooling_inputs import encode
from shared.catalog import ModelProfile
from shared.wire import PoolingRequest
from tests import tiny_poolers
from tests.unit.node_agent.test_pooler import TEXTS


def run_on_cuda(folder, kind: str, request: PoolingRequest):
    profile = ModelProfile(
        id=folder.name,
        source=str(folder),
        kind=kind,
        dtype="float32",
        max_model_len=64,
        pooling_batch_tokens=48,
    )
    engine = PoolingEngine(pooling.load(profile, "cuda"), profile)
    engine.add(request.job, encode(engine.lm, request), request.dimensions, 0.0)
    done = []
    while engine.has_work:
        done += engine.core_step().done
    return done[0].pooled


@pytest.mark.parametrize("mode,decoder", [("mean", False), ("last", True)])
def test_vectors_on_cuda_equal_the_reference(tmp_path, mode, decoder):
    folder = tiny_poolers.build_embedder(
        tmp_path / mode, pooling="lasttoken" if decoder else "mean_tokens", decoder=decoder
    )
    pooled = run_on_cuda(
        folder, "embedding", PoolingRequest(job="j", model="m", kind="embed", inputs=TEXTS)
    )
    got = np.stack([np.frombuffer(v, dtype="<f4") for v in pooled.vectors])
    np.testing.assert_allclose(got, tiny_poolers.reference_vectors(folder, TEXTS, mode), atol=1e-4)


def test_rerank_scores_on_cuda_equal_the_heads_logits(tmp_path):
    folder = tiny_poolers.build_cross_encoder(tmp_path / "rerank")
    query, documents = "what is the sea?", TEXTS
    pooled = run_on_cuda(
        folder,
        "rerank",
        PoolingRequest(
            job="j", model="m", kind="rerank", inputs=documents, queries=[query] * len(documents)
        ),
    )
    raw = tiny_poolers.reference_logits(folder, query, documents)
    np.testing.assert_allclose(pooled.scores, torch.sigmoid(raw).numpy(), atol=1e-4)
