"""Quantized weights under tensor parallelism (node_agent/model/linear_shards.py), on CPU over gloo
as tests/unit/node_agent/test_tensor_parallel.py runs it: a GGUF file served as stored (Q4_0, Q4_1,
Q8_0), a full-precision model quantized at load (`quant = "int4"`) and AWQ/GPTQ checkpoints load on
two ranks, each holding half of the quantized layers' bytes (rank 1 says its own in its ready
line; placement's estimate of one device's weights counts as much), and the engine's greedy
tokens over the two ranks equal the same quantized model's on one device, but for a near tie
(NEAR_TIE) that bfloat16 rounding may swap. A split that would cut a 4-bit group or an int4 tile
is refused with the reason."""

import re

import pytest
import torch
from gguf import GGMLQuantizationType as T

from node_agent.engine.engine import Engine
from node_agent.model import loader
from node_agent.model.linear_shards import Shard
from node_agent.model.quantized_linear import Int4Linear, Int8Linear
from node_agent.tp import tensor_parallel
from shared import memory
from shared.model_files import ModelLoadError, locate
from tests import gguf_files, tiny_models
from tests.model_fixtures import tiny_profile
from tests.unit.node_agent import engine_driver as driver
from tests.unit.node_agent.test_checkpoint_quant import checkpoints  # noqa: F401  (a fixture)
from tests.unit.node_agent.test_tensor_parallel import CPUS, SETTINGS

SIZE = {}  # hidden 64, MLP 128: whole 4-bit groups and int4 tiles on either of two ranks


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, checkpoints):  # noqa: F811
    """name -> the profile of a tiny llama quantized that way."""
    root = tmp_path_factory.mktemp("quantized-tp")
    folder = tiny_models.build("llama", root / "llama", tiny_models.make_tokenizer(), **SIZE)

    def make(name: str):
        if name in ("awq", "gptq"):
            profile = checkpoints(name)[0]
        elif name in ("int4", "int8"):
            profile = tiny_profile(folder, id=f"llama-{name}", quant=name)
        else:
            path = gguf_files.write(folder, root / f"llama-{name}.gguf", T[name])
            profile = tiny_profile(path, id=path.stem, tokenizer_source=str(folder))
        return profile.model_copy(update={"slots": 4, "prefill_chunk_tokens": 16})

    return make


def quantized_bytes(model: torch.nn.Module) -> int:
    layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    return sum(t.numel() * t.element_size() for m in layers for t in m.buffers())


def estimated_weight_bytes(profile) -> int:
    """What placement's estimate (shared/memory.py) counts of the weights on each of the model's devices."""
    files = locate(profile)
    return memory.device_weight_bytes(
        profile, memory.stored_facts(files)[0], 4, bool(files.gguf_file)
    )


def greedy_requests() -> list:
    """Greedy jobs, more than slots, long prompts read in 16-token chunks, each with its top two
    logprobs (to tell a near tie)."""
    return [
        driver.request(
            f"j{i}",
            p,
            kind="completion",
            max_tokens=8 + i,
            temperature=0,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=2,
        )
        for i, p in enumerate(driver.PROMPTS)
    ]


def parted_at(got: driver.Result, want: driver.Result) -> int | None:
    """Where the two ranks' greedy tokens first differ from one device's; None where they do not."""
    return next(
        (i for i, (a, b) in enumerate(zip(got.token_ids[0], want.token_ids[0])) if a != b), None
    )


# The ranks sum bfloat16 partial products (the kernels' output dtype) where one device rounds the whole
# product once: logits differ by bfloat16 rounding, so two tokens tied closer than this may swap.
NEAR_TIE = 0.02  # nats between one device's top two logprobs


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "int4", "awq", "gptq"])
def test_two_ranks_hold_half_the_quantized_weights_each_and_decode_what_one_device_does(
    quantized, name, capfd
):
    profile = quantized(name)
    single = loader.load(profile, "cpu")
    expected = driver.run(Engine(single, profile), *greedy_requests())
    sharded = profile.model_copy(update={"tensor_parallel": 2})
    lm = tensor_parallel.load(sharded, CPUS, SETTINGS)
    whole, rank0 = quantized_bytes(single.model), quantized_bytes(lm.model)
    engine = Engine(lm, sharded)
    try:
        got = driver.run(engine, *greedy_requests())
    finally:
        engine.drop_model()
    assert lm.quant == single.quant == ("int8" if name == "Q8_0" else "int4")
    assert rank0 == pytest.approx(
        whole / 2, rel=0.01
    )  # (an 8-bit row-parallel layer keeps its rows' scales whole)
    rank1 = int(
        re.search(
            r"rank 1 of 2 on cpu:1 ready \(pid \d+, (\d+) bytes of weights\)",
            capfd.readouterr().err,
        )[1]
    )
    assert rank1 == lm.weight_bytes < single.weight_bytes
    # the embedding and norms whole, the projections halved (over by GPTQ's zero biases the node drops, under
    # by Q8_0's per-row scales: 2% at most; counting the embedding at half would be 25-50% under)
    assert estimated_weight_bytes(sharded) == pytest.approx(lm.weight_bytes, rel=0.03)
    parted = {}
    for job, want in expected.items():
        if (at := parted_at(got[job], want)) is not None:
            top_two = want.logprobs[0][at].top_logprobs
            parted[job] = (at, top_two[0].logprob - top_two[1].logprob)
    print(
        f"{name}: quantized layers {whole} bytes on one device, {rank0} on each of two ranks (all weights: "
        f"{single.weight_bytes}, {lm.weight_bytes}, {rank1}); parted (job: token, one device's top-two gap): {parted}"
    )
    assert all(gap < NEAR_TIE for _, gap in parted.values()) and len(parted) <= 1, parted


def test_int8_at_load_shards_as_weight_only_8_bit_layers(quantized):
    """A CPU's int8 on one device is torch's dynamic int8, which does not shard (its answers depend
    on the batch, too): two ranks hold Int8Linear's weight-only layers, as a GPU does."""
    profile = quantized("int8").model_copy(update={"tensor_parallel": 2})
    lm = tensor_parallel.load(profile, CPUS, SETTINGS)
    layers = [m for m in lm.model.modules() if isinstance(m, Int8Linear)]
    engine = Engine(lm, profile)
    try:
        got = driver.run(engine, *greedy_requests()[:2])
    finally:
        engine.drop_model()
    assert lm.quant == "int8" and len(layers) == 14  # q k v o gate up down, 2 layers
    assert [len(got[j].token_ids[0]) for j in ("j0", "j1")] == [8, 9]


@pytest.mark.parametrize(
    "shard, shape, reason",
    [
        (
            Shard("o_proj", "rowwise", 0, 2),
            (64, 96),
            r"its 96 inputs cut into columns of 48, which splits a 4-bit group",
        ),
        (
            Shard("q_proj", "colwise", 1, 2),
            (48, 64),
            r"its 48 output rows cut into rows of 24, which splits the int4 "
            r"kernels' tiles of 16",
        ),
    ],
)
def test_a_split_that_cuts_a_4_bit_group_or_tile_is_refused_with_the_reason(shard, shape, reason):
    codes, groups = torch.zeros(shape, dtype=torch.uint8), torch.ones(shape[0], shape[1] // 32)
    with pytest.raises(
        ModelLoadError, match=f"{shard.name} cannot be split over 2 ranks: {reason}"
    ):
        shard.int4(codes, groups, groups)


def test_a_shard_is_the_whole_layers_rows_or_group_aligned_columns():
    codes, scale = torch.arange(64 * 128).reshape(64, 128), torch.arange(64 * 4).reshape(64, 4)
    top, _, _ = Shard("q", "colwise", 0, 2).int4(codes, scale, scale)
    right, right_scale, _ = Shard("o", "rowwise", 1, 2).int4(codes, scale, scale)
    assert (
        torch.equal(top, codes[:32])
        and torch.equal(right, codes[:, 64:])
        and torch.equal(right_scale, scale[:, 2:])
    )


def test_a_gguf_file_shards_only_as_stored(quantized):
    profile = quantized("Q4_0").model_copy(update={"tensor_parallel": 2, "quant": "none"})
    with pytest.raises(
        ModelLoadError,
        match=r"a .gguf file shards with its Linear weights quantized as it stores "
        r"them \(quant = 'auto'\)",
    ):
        tensor_parallel.load(profile, CPUS, SETTINGS)
