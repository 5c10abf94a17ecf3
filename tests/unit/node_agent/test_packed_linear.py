"""Linear layers packed for oneDNN (node_agent/model/packed_linear.py): a packed layer computes
what `F.linear` does, and a CPU model's plain Linear layers are packed at load, quantized ones left
as they are."""

import torch
import torch.nn.functional as F

from node_agent.model import loader
from node_agent.model.packed_linear import PackedLinear
from node_agent.model.quantized_linear import Int4Linear
from tests.model_fixtures import tiny_profile


def test_a_packed_layer_computes_what_the_plain_one_does():
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(96, 200), torch.randn(5, 3, 96)
    assert torch.allclose(PackedLinear(layer)(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_a_4_bit_cpu_model_packs_its_plain_layers_and_keeps_its_quantized_ones(small_vocab_dirs):
    lm = loader.load(tiny_profile(small_vocab_dirs["llama"], quant="int4"), "cpu")
    kinds = {type(m) for m in lm.model.modules()}
    assert Int4Linear in kinds and torch.nn.Linear not in kinds
    assert isinstance(
        lm.model.get_output_embeddings(), PackedLinear
    )  # the head stays full precision
