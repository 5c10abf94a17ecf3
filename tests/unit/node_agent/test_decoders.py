"""The fixed-shape decode step on CPU: padded buckets never change real rows, the step compiles
with fullgraph=True (no host sync, no data-dependent Python: what a CUDA graph needs too)."""

import pytest
import torch

from node_agent import decoders, forward
from node_agent.engine import Engine
from shared.errors import InvalidRequest
from tests.unit.node_agent.engine_driver import PROMPTS, request, run


def test_buckets():
    assert decoders.batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decoders.batch_buckets(6) == [1, 2, 4, 6]
    assert decoders.kv_buckets(1000) == [128, 256, 512, 1000]
    assert decoders.bucket([1, 2, 4, 8], 3) == 4


def test_padded_static_steps_equal_eager_steps(tiny_llama):
    profile, lm = tiny_llama
    reqs = [request(f"j{i}", p, temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i, p in enumerate(PROMPTS[:5])]
    eager = run(Engine(lm, profile.model_copy(update={"decode": "eager"})), *reqs)
    static_engine = Engine(lm, profile.model_copy(update={"decode": "static"}))
    assert isinstance(static_engine.decoder, decoders.StaticDecoder)
    static = run(static_engine, *reqs)  # 5 rows pad to 8, then 4 rows..., as sequences finish
    assert {j: r.token_ids for j, r in static.items()} == {j: r.token_ids for j, r in eager.items()}


def test_padding_rows_write_only_the_scratch_column(tiny_llama):
    profile, lm = tiny_llama
    engine = Engine(lm, profile.model_copy(update={"decode": "static", "slots": 4}))
    before = [k.clone() for k in engine.cache.keys]
    with torch.inference_mode():
        engine.decoder([5, 6, 7], [0, 1, 2])  # pads to 4 rows; row 3 writes the scratch column
    for old, new in zip(before, engine.cache.keys):
        assert torch.equal(old[3, :, : engine.cache.max_len], new[3, :, : engine.cache.max_len])
        assert not torch.equal(old[0, :, 0], new[0, :, 0])


def test_decode_step_compiles_with_fullgraph(tiny_llama):
    profile, lm = tiny_llama
    engine = Engine(lm, profile.model_copy(update={"slots": 4}))
    tokens, positions = torch.tensor([5, 6, 7, 8]), torch.tensor([3, 10, 0, engine.cache.scratch_column])
    with torch.inference_mode():
        eager = forward.decode_step(lm.model, engine.cache, tokens, positions, 32)
        compiled = torch.compile(forward.decode_step, fullgraph=True)(lm.model, engine.cache, tokens, positions, 32)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sampling, param", [(dict(logit_bias={10**6: 1.0}), "logit_bias"), (dict(), "prompt")])
def test_token_ids_outside_the_vocabulary_are_refused(tiny_llama, sampling, param):
    profile, lm = tiny_llama
    engine = Engine(lm, profile)
    prompt = [1, 2, 10**6] if param == "prompt" else [1, 2]
    req = request("j", kind="completion", **sampling)
    with pytest.raises(InvalidRequest) as err:
        engine.add(req, prompt, 0.0)
    assert err.value.param == param and not engine.has_work


def test_an_empty_prompt_is_refused(tiny_llama):
    profile, lm = tiny_llama
    with pytest.raises(InvalidRequest):
        Engine(lm, profile).add(request("j", kind="completion"), [], 0.0)
