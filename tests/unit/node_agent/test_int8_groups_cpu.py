"""8-bit groups read as stored on a CPU (node_agent/model/int8_groups_cpu.py): both of the kernel's
paths (few rows summed in registers, many rows through dequantised tiles) equal the dequantised
weights' matmul in float32, a row reads the same alone and in a batch, and a compiled call equals
an eager one."""

import pytest
import torch

from node_agent.model import int8_groups_cpu
from node_agent.model.int8_groups_cpu import CpuInt8GroupLinear

pytestmark = pytest.mark.skipif(
    not int8_groups_cpu.runs(), reason="the CPU kernels are not built here"
)


def layer_and_weight(out_features: int, in_features: int, bias: bool = False):
    """A random layer (codes at both ends of -128..127 included) and its dequantised weight [out, in]."""
    generator = torch.Generator().manual_seed(out_features * in_features)
    codes = torch.randint(-128, 128, (out_features, in_features), generator=generator).to(
        torch.int8
    )
    codes[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scale = torch.rand(out_features, in_features // 32, generator=generator) * 0.01 + 1e-3
    weight = codes.float() * scale.repeat_interleave(32, dim=1)
    b = torch.randn(out_features, generator=generator) if bias else None
    return CpuInt8GroupLinear(codes, scale, b), weight


# 3 rows and under: in registers, 4 and up: tiles
@pytest.mark.parametrize("shape", [(128, 64), (192, 96)], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 33, 130])
def test_both_paths_equal_the_dequantised_matmul(shape, rows):
    layer, weight = layer_and_weight(*shape, bias=True)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    want = (x.double() @ weight.double().T + layer.bias.double()).float()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)


def test_activations_in_bfloat16_come_back_in_bfloat16():
    layer, weight = layer_and_weight(128, 64)
    x = torch.randn(2, 3, 64).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 128)
    torch.testing.assert_close(got, (x.float() @ weight.T).bfloat16())


def test_a_row_reads_the_same_alone_and_in_a_batch():
    layer, _ = layer_and_weight(192, 96)
    batch = torch.randn(32, 96, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(batch[5:6]), layer(batch)[5:6], rtol=1e-5, atol=1e-5)


def test_a_compiled_call_equals_an_eager_one():
    layer, _ = layer_and_weight(128, 64)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for rows in (2, 9):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(compiled(x), layer(x))


def test_a_layer_of_part_blocks_is_refused():
    assert not int8_groups_cpu.fits(100) and int8_groups_cpu.fits(49152)
    with pytest.raises(ValueError, match="whole blocks of 64"):
        CpuInt8GroupLinear(torch.zeros(100, 64, dtype=torch.int8), torch.ones(100, 2), None)
