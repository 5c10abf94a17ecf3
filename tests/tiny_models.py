"""Tiny random-weight causal LMs built at test time, saved as a transformers would save them,
with the default model's tokenizer (so chat templates and detokenisation are real), or with a
small byte-level tokenizer trained here (`make_tokenizer`) where the default model's GGUF is
not installed (an offline GPU host)."""

from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

ARCHITECTURES = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]),
}


def build(arch: str, folder: Path, tokenizer, seed: int = 0) -> Path:
    """Save a 2-layer random model of `arch` (hidden 64) with `tokenizer` into `folder`."""
    spec = dict(ARCHITECTURES[arch])
    config = AutoConfig.for_model(
        spec.pop("model_type"), vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True, **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The capital of France is Paris.", "Write a poem about the sea and the sky.", "1 2 3 4 5 6 7 8 9 10",
          "Tell me about transformers and attention in detail please.", "Hello there! Why? What is it?"]


def make_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes; every id decodes) with a ChatML template."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 20, vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   bos_token="<|endoftext|>", chat_template=CHATML)
