"""The fixed-shape decode step on CPU: padded buckets write only the null block (and keep a
padding row's linear-attention state), the step over block tables compiles with fullgraph=True (no
host sync, no data-dependent Python: what a CUDA graph needs too)."""

import pytest
import torch

from node_agent.engine.engine import Engine
from node_agent.model import compiled_step, decoders, forward, loader
from node_agent.model.kv_cache import LinearAttentionState
from shared.errors import InvalidRequest
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent.engine_driver import PROMPTS, request, run


def test_buckets():
    assert decoders.batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decoders.batch_buckets(6) == [1, 2, 4, 6]
    assert decoders.kv_buckets(1000) == [128, 256, 512, 1000]
    assert decoders.bucket([1, 2, 4, 8], 3) == 4


def test_padded_static_steps_equal_eager_steps(tiny_llama):
    profile, lm = tiny_llama
    reqs = [
        request(f"j{i}", p, temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
        for i, p in enumerate(PROMPTS[:5])
    ]
    eager = run(Engine(lm, profile.model_copy(update={"decode": "eager"})), *reqs)
    static_engine = Engine(lm, profile.model_copy(update={"decode": "static"}))
    assert isinstance(static_engine.decoder, decoders.StaticDecoder)
    static = run(static_engine, *reqs)  # 5 rows pad to 8, then 4 rows..., as sequences finish
    assert {j: r.token_ids for j, r in static.items()} == {j: r.token_ids for j, r in eager.items()}


def _tables(cache, rows: int) -> torch.Tensor:
    """Rows 0..rows-1 hold blocks 1..rows, one each."""
    tables = torch.zeros(rows, cache.max_blocks, dtype=torch.long)
    tables[:, 0] = torch.arange(1, rows + 1)
    return tables


def test_padding_rows_write_only_the_null_block(tiny_llama):
    profile, lm = tiny_llama
    engine = Engine(lm, profile.model_copy(update={"decode": "static", "slots": 4}))
    cache, size = engine.cache, engine.cache.block_size
    cache.set_tables(_tables(cache, 4))  # row 3 (padding below) holds block 4
    before = [layer.keys.clone() for layer in cache.layers]
    with torch.inference_mode():
        engine.decoder([5, 6, 7], [0, 1, 2])  # pads to 4 rows; row 3 writes the null block
    for old, layer in zip(before, cache.layers):
        changed = (
            (old != layer.keys).any(-1).any(0).nonzero().flatten().tolist()
        )  # [heads, slots, dim]
        assert set(changed) - {0} == {
            size,
            2 * size + 1,
            3 * size + 2,
        }  # slot 0: the null block's first


def test_padding_rows_keep_their_linear_attention_state(small_vocab_dirs):
    profile = tiny_profile(small_vocab_dirs["qwen3_5_text"], decode="static", slots=4)
    engine = Engine(loader.load(profile, "cpu"), profile)
    linear = [layer for layer in engine.cache.layers if isinstance(layer, LinearAttentionState)]
    for tensor in (t for layer in linear for t in layer.tensors):
        tensor.normal_()  # row 3 holds a sequence's state (one still reading its prompt, say)
    before = [[t.clone() for t in layer.tensors] for layer in linear]
    with torch.inference_mode():
        engine.decoder([5, 6, 7], [4, 9, 2])  # pads to 4 rows
    for old, layer in zip(before, linear):
        for old_tensor, tensor in zip(old, layer.tensors):
            assert torch.equal(old_tensor[3], tensor[3])
            assert not torch.equal(old_tensor[:3], tensor[:3])


def _cache_tensors(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer.tensors]


@pytest.mark.slow  # torch.compile of a whole step (15-30 s each)
@pytest.mark.parametrize(
    "arch", ["llama", "qwen3_5_text"]
)  # full attention; linear attention and full
def test_decode_step_compiles_with_fullgraph(small_vocab_dirs, arch):
    profile = tiny_profile(
        small_vocab_dirs[arch], slots=4, decode="eager"
    )  # the step compiled here, as a GPU's
    lm = loader.load(profile, "cpu")
    engine = Engine(lm, profile)
    engine.cache.set_tables(_tables(engine.cache, 4))
    tokens, positions = (
        torch.tensor([5, 6, 7, 8]),
        torch.tensor([3, 10, 0, engine.cache.scratch_position]),
    )
    rope_offsets = torch.tensor(
        [0, -4, 0, 0]
    )  # a row after an image in an M-RoPE model rotates behind its column
    start = [t.clone() for t in _cache_tensors(engine.cache)]
    with torch.inference_mode():
        eager = forward.decode_step(lm.model, engine.cache, tokens, positions, rope_offsets, 32)
        for tensor, saved in zip(
            _cache_tensors(engine.cache), start
        ):  # a linear state moves on at each step
            tensor.copy_(saved)
        compiled = torch.compile(forward.decode_step, fullgraph=True)(
            lm.model, engine.cache, tokens, positions, rope_offsets, 32
        )
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_a_compiled_step_that_cannot_compile_a_call_decodes_eagerly_from_then_on(tiny_llama):
    """A call that would need a graph torch cannot make (a recompile past its limit, say) is run
    eagerly, and so is every later one: the replica keeps serving rather than failing its jobs."""
    profile, lm = tiny_llama
    engine = Engine(lm, profile.model_copy(update={"decode": "eager"}))
    step, tried = compiled_step.CompiledStep(), []

    def cannot(*args):
        tried.append(args)
        raise torch._dynamo.exc.Unsupported("another graph needed")

    step.compiled = cannot
    tokens, positions, offsets = (
        torch.tensor([5, 6]),
        torch.tensor([3, 4]),
        torch.zeros(2, dtype=torch.long),
    )
    with torch.inference_mode():
        first, second = (
            step(lm.model, engine.cache, tokens, positions, offsets, 32) for _ in range(2)
        )
        eager = forward.decode_step(lm.model, engine.cache, tokens, positions, offsets, 32)
    assert step.eager and len(tried) == 1
    torch.testing.assert_close(first, eager)
    torch.testing.assert_close(second, eager)


@pytest.mark.parametrize(
    "sampling, param", [(dict(logit_bias={10**6: 1.0}), "logit_bias"), (dict(), "prompt")]
)
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
