"""A CPU model's fused layers (node_agent/model/fused_layers.py): RMSNorm as one ATen call gives
transformers' Llama RMSNorm's numbers in float32 and bfloat16; a gated MLP over its stacked gate
and up weights gives Llama's MLP's within float rounding, and so do an attention's stacked query,
key and value projections (one matmul a call); layers with another forward (Gemma's 1 + weight
norm, quantized projections) stay."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from node_agent.model import fused_layers, quantized_linear


@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_a_fused_norm_gives_llamas_numbers(dtype, weight_dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5).to(weight_dtype)
    norm.weight.data.normal_()
    x = torch.randn(3, 5, 96).to(dtype) * 4
    got, want = fused_layers.FusedRMSNorm(norm)(x), norm(x)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_a_fused_mlp_gives_llamas_numbers(bias, act):
    torch.manual_seed(0)
    mlp = LlamaMLP(
        LlamaConfig(hidden_size=64, intermediate_size=160, mlp_bias=bias, hidden_act=act)
    )
    x = torch.randn(2, 7, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fused_layers.FusedMLP(mlp)(x), mlp(x), atol=1e-6, rtol=1e-5)


def test_only_layers_whose_forward_is_llamas_are_replaced():
    config = LlamaConfig(hidden_size=64, intermediate_size=128)
    quantized = Qwen3MLP(config)
    quantized.gate_proj = quantized_linear.Int8Linear.quantize(quantized.gate_proj.weight)
    model = torch.nn.ModuleDict(
        {
            "llama": LlamaRMSNorm(8),
            "qwen3": Qwen3RMSNorm(8),
            "gemma": GemmaRMSNorm(8),
            "inner": torch.nn.ModuleDict({"norm": LlamaRMSNorm(8), "mlp": Qwen3MLP(config)}),
            "quantized": quantized,
        }
    )
    assert fused_layers.fuse(model) == 4
    assert isinstance(model["llama"], fused_layers.FusedRMSNorm) and isinstance(
        model["qwen3"], fused_layers.FusedRMSNorm
    )
    assert isinstance(model["inner"]["norm"], fused_layers.FusedRMSNorm)
    assert isinstance(model["inner"]["mlp"], fused_layers.FusedMLP)
    assert type(model["gemma"]) is GemmaRMSNorm and type(model["quantized"]) is Qwen3MLP


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_qkv_projections_give_the_attentions_numbers_with_one_matmul_a_call(bias):
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, attention_bias=bias
    )
    attention = LlamaAttention(config, layer_idx=0).eval()
    x = torch.randn(2, 7, 64)
    rotary = LlamaRotaryEmbedding(config)(x, torch.arange(7)[None].expand(2, -1))
    with torch.inference_mode():
        want = attention(x, rotary, None)[0]
        assert fused_layers.fuse(attention) == 1
        stacked = attention.qkv_proj.stacked
        calls = []
        stacked.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
        got = attention(x, rotary, None)[0]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert calls == [(2, 7, 64)]  # one matmul for q, k and v
        assert attention.qkv_proj._parts == ()  # nothing held between calls
        # a part called on its own input computes it: any order, any input, the same numbers
        other = torch.randn(3, 64)
        torch.testing.assert_close(
            attention.v_proj(other),
            other @ stacked.weight[-32:].t() + (stacked.bias[-32:] if bias else 0),
            atol=1e-6,
            rtol=1e-5,
        )


def test_projections_that_are_not_plain_linear_layers_are_not_stacked():
    attention = LlamaAttention(LlamaConfig(hidden_size=64, num_attention_heads=4), layer_idx=0)
    attention.k_proj = quantized_linear.Int8Linear.quantize(attention.k_proj.weight)
    assert fused_layers.fuse(attention) == 0 and type(attention.q_proj) is torch.nn.Linear
