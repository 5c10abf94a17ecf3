"""The two CPU paths of a 4-bit layer (node_agent/model/int4_tiles.py, `cortex::int4_linear`):
torch's int4 kernel below the rows from which the tiles run (4 or 8, by torch's packing on this
CPU), the dequantised tiles from there, each equal to the dequantised weights' matmul on
bfloat16-rounded inputs, a row's result the same whichever path runs it, and a layer bound to the
kernel (as a node's are) giving what an unbound one gives, eagerly and in a compiled call."""

import pytest
import torch

from node_agent.model import int4_tiles, quantized_linear
from node_agent.model.quantized_linear import GROUP, Int4Linear, round_int4

pytestmark = pytest.mark.skipif(
    int4_tiles.layout() is None, reason="the CPU kernels are not built here"
)


def layer_and_weight(out_features: int, in_features: int) -> tuple[Int4Linear, torch.Tensor]:
    """A random 4-bit layer and its dequantised weight [out, in] (what both paths must multiply by)."""
    generator = torch.Generator().manual_seed(out_features * in_features)
    codes, scale, zero = round_int4(torch.randn(out_features, in_features, generator=generator))
    layer = Int4Linear(codes, scale, zero, torch.randn(out_features, generator=generator))
    sz = layer.scales_and_zeros.float()  # bfloat16 as the kernels read them: [in / GROUP, out, 2]
    groups = (codes.float() - 8).reshape(out_features, -1, GROUP)
    weight = groups * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
    return layer, weight.reshape(out_features, in_features)


@pytest.mark.parametrize(
    "shape", [(576, 576), (192, 576), (576, 1536), (80, 64)]
)  # SmolLM2's q/o, k/v, down; a last block narrower than torch's
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 33, 130, 512])
def test_both_paths_equal_the_dequantised_matmul(shape, rows):
    layer, weight = layer_and_weight(*shape)
    x = torch.randn(rows, shape[1])
    expected = x.bfloat16().float() @ weight.t() + layer.bias
    y = layer(x)
    assert y.dtype == x.dtype and y.shape == (rows, shape[0])
    # both paths return bfloat16 products (8 bits of mantissa) of sums of up to 1536 terms
    torch.testing.assert_close(y, expected, rtol=1e-2, atol=2e-2 * expected.abs().max().item())


# 32 rows: float32 tiles; 130: on a CPU with AMX, bfloat16 GEMMs over each weight's two halves
@pytest.mark.parametrize("rows", [32, 130])
def test_a_row_reads_the_same_alone_and_in_a_batch(rows):
    layer, _ = layer_and_weight(576, 1536)
    x = torch.randn(rows, 1536)
    alone = torch.cat([layer(row[None]) for row in x])  # torch's int4 kernel
    batched = layer(x)  # the tiles
    close = torch.isclose(alone, batched, rtol=1e-2, atol=1e-3)
    assert close.float().mean() > 0.999  # apart from bfloat16's rounding of a rare near-tie
    torch.testing.assert_close(alone, batched, rtol=2e-2, atol=1e-2)


def test_the_layout_is_found_for_this_cpu():
    assert int4_tiles.layout() in {(64, True), (32, True), (32, False), (64, False)}
    layer, weight = layer_and_weight(80, 64)
    eye = torch.eye(64)
    dequantised = torch.ops.cortex.int4_tiled_matmul(
        eye, layer.weight_packed, layer.scales_and_zeros, GROUP, *int4_tiles.layout()
    )
    torch.testing.assert_close(dequantised, weight.t(), rtol=0, atol=0)


TILED_FROM = int4_tiles.kernel_args()[2] if int4_tiles.layout() else 0


def test_the_tiles_start_at_4_rows_with_avx2_packing_and_8_with_avx512():
    assert TILED_FROM == {32: 4, 64: 8}[int4_tiles.layout()[0]]


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 33])
def test_a_bound_layer_gives_what_an_unbound_one_does_eagerly_and_compiled(rows):
    layer, _ = layer_and_weight(576, 576)
    x = torch.randn(rows, 576)
    unbound = layer(x)
    model = torch.nn.Sequential(layer)
    assert int4_tiles.bind(model) == 1 and layer.cpu_kernel == int4_tiles.kernel_args()
    torch.testing.assert_close(layer(x), unbound, rtol=0, atol=0)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), unbound, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, TILED_FROM, 33])  # torch's int4 kernel, then the tiles
def test_stacked_layers_give_their_parts_outputs_side_by_side(rows):
    """q/k/v and gate/up stacked as one 4-bit layer (node_agent/model/fused_layers.py): each output
    channel is the same sum in the same order, so the parts read back exactly."""
    parts = [layer_and_weight(out, 576)[0] for out in (576, 192, 192)]
    assert quantized_linear.stackable(parts)
    stack = Int4Linear.stacked(parts)
    x = torch.randn(rows, 576)
    assert torch.equal(stack(x), torch.cat([part(x) for part in parts], dim=-1))
    assert not quantized_linear.stackable([layer_and_weight(80, 64)[0]])  # a part-block of outputs


def test_a_prefill_chunks_product_carries_each_weight_in_full():
    """From 128 rows on a CPU with AMX the tiles run as two bfloat16 GEMMs, over each weight rounded
    to bfloat16 and over what that rounding left: float32's product within float32's rounding, not
    bfloat16's (one bfloat16 GEMM over the rounded weights: 1.6e-3 of the largest here)."""
    layer, weight = layer_and_weight(576, 576)
    x = torch.randn(256, 576).bfloat16().float()  # the kernels' activations are bfloat16's values
    got = torch.ops.cortex.int4_tiled_matmul(
        x, layer.weight_packed, layer.scales_and_zeros, GROUP, *int4_tiles.layout()
    )
    want = x.double() @ weight.double().t()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


# torch's kernel, the tiles, and (on a CPU with AMX) the bfloat16 tiles
@pytest.mark.parametrize("rows", [1, TILED_FROM, 33, 130])
def test_a_float32_models_rows_need_no_conversion_around_the_kernel(rows):
    """`cortex::int4_linear` takes a float32 model's activations as they are and gives float32 back:
    the same values as through bfloat16 (inputs rounded to it, products to its precision), whichever
    path runs the rows."""
    layer, _ = layer_and_weight(576, 576)
    x = torch.randn(rows, 576)
    args = (layer.weight_packed, layer.scales_and_zeros, GROUP, *int4_tiles.kernel_args())
    through_bf16 = torch.ops.cortex.int4_linear(x.bfloat16(), *args)
    as_float32 = torch.ops.cortex.int4_linear(x, *args)
    assert through_bf16.dtype == torch.bfloat16 and as_float32.dtype == torch.float32
    assert torch.equal(as_float32, through_bf16.float())
