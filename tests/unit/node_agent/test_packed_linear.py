"""Linear layers packed for oneDNN (node_agent/model/packed_linear.py): a packed layer computes
what `F.linear` does; a quantized model's output head, packed in bfloat16 where the CPU has bf16
instructions, computes the float32 head's logits within bfloat16's rounding and hands back the
model's dtype."""

import pytest
import torch
import torch.nn.functional as F

from node_agent.model import devices, loader
from node_agent.model.packed_linear import PackedLinear, pack
from node_agent.model.quantized_linear import Int4Linear
from tests.model_fixtures import tiny_profile


def test_a_packed_layer_computes_what_the_plain_one_does():
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(96, 200), torch.randn(5, 3, 96)
    assert torch.allclose(PackedLinear(layer)(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_a_head_packed_in_bfloat16_gives_the_float32_logits_within_its_rounding():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 500, bias=False))
    model.get_output_embeddings = lambda: model[1]
    x = torch.randn(4, 64)
    want = model(x)
    assert pack(model, head_dtype=torch.bfloat16) == 2
    assert model[0].weight.dtype == torch.float32 and model[1].weight.dtype == torch.bfloat16
    got = model(x)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


@pytest.mark.skipif(not devices.cpu_has_fast_bf16(), reason="this CPU has no bf16 instructions (AVX-512 bf16 or "
                                                               "AMX): a quantized model keeps its head in float32")
def test_a_4_bit_model_on_a_bf16_cpu_packs_its_output_head_in_bfloat16(small_vocab_dirs):
    lm = loader.load(tiny_profile(small_vocab_dirs["llama"], quant="int4"), "cpu")
    assert any(isinstance(m, Int4Linear) for m in lm.model.modules())
    head = lm.model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.weight.dtype == torch.bfloat16
    plain = loader.load(tiny_profile(small_vocab_dirs["llama"]), "cpu")  # not quantized: its head as its dtype
    assert plain.model.get_output_embeddings().weight.dtype == torch.float32
