"""Linear layers packed for oneDNN (node_agent/model/packed_linear.py): a packed layer computes
what `F.linear` does, and a CPU model's plain Linear layers are packed at load, quantized ones left
as they are."""

import torch
import torch.nn.functional as F

from node_agent.model import loader
from node_agent.model.packed_linear import PackedLinear, packable
from node_agent.model.quantized_linear import Int4Linear
from tests.model_fixtures import tiny_profile


def test_a_packed_layer_computes_what_the_plain_one_does():
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(96, 200), torch.randn(5, 3, 96)
    assert torch.allclose(PackedLinear(layer)(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_a_bfloat16_layer_is_packed_only_where_onednn_can_and_then_computes_what_it_did():
    """On a CPU without AVX-512 (or AVX-NE-CONVERT) oneDNN has no bfloat16 packing: such a model's
    layers run unpacked, as `packable` says, rather than failing its load."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96).to(torch.bfloat16)
    why = packable(layer)
    assert (why is None) == torch.ops.mkldnn._is_mkldnn_bf16_supported(), why
    if why is None:
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        want = F.linear(x, layer.weight, layer.bias).float()
        assert torch.allclose(PackedLinear(layer)(x).float(), want, atol=0.05, rtol=0.02)


def test_a_4_bit_cpu_model_packs_its_plain_layers_and_keeps_its_quantized_ones(small_vocab_dirs):
    lm = loader.load(tiny_profile(small_vocab_dirs["llama"], quant="int4"), "cpu")
    kinds = {type(m) for m in lm.model.modules()}
    assert Int4Linear in kinds and torch.nn.Linear not in kinds
    assert isinstance(
        lm.model.get_output_embeddings(), PackedLinear
    )  # the head stays full precision
