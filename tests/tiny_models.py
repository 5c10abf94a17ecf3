"""Tiny random-weight causal LMs built at test time, saved as a transformers would save them,
with the default model's tokenizer (so chat templates and detokenisation are real), or with a
small byte-level tokenizer trained here (`make_tokenizer`) where the default model's GGUF is
not installed (an offline GPU host)."""

import copy
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

_LINEAR_ATTENTION = dict(
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_hidden_layers=4,
)  # 3 linear, 1 full
_SLIDING = dict(
    sliding_window=8,
    head_dim=16,
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
)
_GEMMA = dict(
    query_pre_attn_scalar=16, tie_word_embeddings=False
)  # tied, its scaled embeddings make one token win
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)

ARCHITECTURES = {  # the architecture matrix (node_agent/model/architectures.py): model_type and config overrides
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=8),  # every layer sliding
    "mixtral": dict(
        model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    ),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, **_MOE),
    "qwen3_5_text": dict(model_type="qwen3_5_text", **_LINEAR_ATTENTION),
    "qwen3_next": dict(
        model_type="qwen3_next", shared_expert_intermediate_size=32, **_LINEAR_ATTENTION, **_MOE
    ),
    "gemma2": dict(model_type="gemma2", **_SLIDING, **_GEMMA),
    "gemma3_text": dict(model_type="gemma3_text", **_SLIDING, **_GEMMA),
    "phi3": dict(model_type="phi3"),
    "olmo2": dict(model_type="olmo2"),
    "granite": dict(model_type="granite", logits_scaling=8.0),
}


def build(arch: str, folder: Path, tokenizer, seed: int = 0, **config: object) -> Path:
    """Save a random model of `arch` (hidden 64, 2 layers, unless its entry says otherwise) with
    `tokenizer` into `folder`; `config` overrides fields of its config (`model_type="gpt2"`
    builds an architecture outside ARCHITECTURES, for tests of what is refused)."""
    spec = (
        dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.2,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=True,
        )
        | ARCHITECTURES[arch]
        | config
    )
    hf_config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris.",
    "Write a poem about the sea and the sky.",
    "1 2 3 4 5 6 7 8 9 10",
    "Tell me about transformers and attention in detail please.",
    "Hello there! Why? What is it?",
]


def make_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes; every id decodes) with a ChatML template."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        CORPUS * 20,
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        bos_token="<|endoftext|>",
        chat_template=CHATML,
    )


def _distinct_tokens(tokenizer, text: str, taken: set[int]) -> list[int]:
    """Token ids that spell `text`, none in `taken` and none twice (any segmentation will do: the
    detokeniser only concatenates)."""
    vocab: dict[str, int] = {}
    for token_id in range(len(tokenizer)):
        vocab.setdefault(tokenizer.decode([token_id]), token_id)
    longest = max(len(piece) for piece in vocab)

    def spell(at: int, used: set[int]) -> list[int] | None:
        if at == len(text):
            return []
        for end in range(min(len(text), at + longest), at, -1):
            token_id = vocab.get(text[at:end])
            if token_id is not None and token_id not in used:
                rest = spell(end, used | {token_id})
                if rest is not None:
                    return [token_id, *rest]
        return None

    ids = spell(0, taken)
    if ids is None:
        raise ValueError(f"cannot spell {text!r} with distinct tokens")
    return ids


def build_scripted(
    folder: Path, tokenizer, replies: dict[int, str], *, context: int = 32768
) -> Path:
    """A Llama whose output is a script: after a prompt whose last token is a key of `replies`, it
    writes that reply, then EOS (after any other prompt, EOS at once), at any temperature.

    Real weights through a real forward pass, set by hand: every layer's output projections are
    zero, so the last hidden state is the current token's embedding and the next token depends
    on it alone (a bigram table: each scripted token has a dimension of its own in the embeddings,
    and the lm_head row of its successor reads it). For protocol tests of clients that need a
    long context and a tool call, which a random model cannot give."""
    taken = set(replies) | {tokenizer.eos_token_id}
    chain: dict[int, int] = {}  # token -> the token after it
    for trigger, text in replies.items():
        ids = _distinct_tokens(tokenizer, text, taken)
        taken |= set(ids)
        for current, following in zip([trigger, *ids], [*ids, tokenizer.eos_token_id]):
            chain[current] = following
    hidden = 1 << max(len(chain) + 1, 64).bit_length()
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=0.02,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        default = hidden - 1  # every unscripted token leans this way, and it reads as EOS
        embed[:, default] = 1.0
        head.zero_()
        head[tokenizer.eos_token_id, default] = 100.0
        for dim, (current, following) in enumerate(chain.items()):
            embed[current] = 0.0
            embed[current, dim] = 1.0
            head[following, dim] = 100.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ---- vision models ----------------------------------------------------------------------------

# A ChatML template that writes each image part as the model's image placeholder (Qwen2-VL's manner).
VISION_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}{{ IMAGE }}{% elif p['type'] == 'text' %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=True,
)


def _qwen_vision(tokenizer) -> tuple[dict, list, str]:
    """What Qwen's vision models share: their image tokens (added to `tokenizer`; returned as the
    config's ids), an image processor making 4 to 16 merged 28x28 patches per image (a few image
    tokens, a real resize) and a template placing them. The processor (which wants torchvision for
    its video half) is saved as its parts: tokenizer, image processor, template."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    start, end, image, video = tokenizer.convert_tokens_to_ids(special)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=4 * 28 * 28,
        max_pixels=16 * 28 * 28,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )
    tokenizer.chat_template = VISION_CHATML.replace(
        "{{ IMAGE }}", "<|vision_start|><|image_pad|><|vision_end|>"
    )
    ids = dict(
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    return ids, [tokenizer, image_processor], tokenizer.chat_template


def _qwen2_5_vl(tokenizer):
    from transformers.models.qwen2_5_vl import Qwen2_5_VLConfig

    ids, parts, template = _qwen_vision(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=TEXT
        | dict(
            vocab_size=len(tokenizer),
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]},
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
            initializer_range=0.2,
        ),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **ids,
    )
    return config, parts, template


def _idefics3(tokenizer):
    """SmolVLM's architecture: a SigLIP-style tower, pixel shuffle, a Llama; images split into tiles."""
    from transformers.models.idefics3 import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    template = VISION_CHATML.replace("{{ IMAGE }}", "<image>")
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=True, size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=4,
        chat_template=template,
    )  # (32 / 8)^2 patches / scale_factor^2 = 4 tokens per tile
    config = Idefics3Config(
        text_config=TEXT
        | dict(
            model_type="llama",
            vocab_size=len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            initializer_range=0.2,
        ),
        scale_factor=2,
        image_token_id=processor.image_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return config, [processor], template


def _qwen3_5(tokenizer):
    """Qwen3.5 with vision: linear-attention and full-attention layers, interleaved M-RoPE."""
    from transformers.models.qwen3_5 import Qwen3_5Config

    ids, parts, template = _qwen_vision(tokenizer)
    text = {k: v for k, v in TEXT.items() if k != "num_hidden_layers"} | _LINEAR_ATTENTION
    config = Qwen3_5Config(
        text_config=text
        | dict(
            vocab_size=len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=16,
            initializer_range=0.2,
        ),
        tie_word_embeddings=True,
        **ids,
    )
    return config, parts, template


def _gemma3(tokenizer):
    """Gemma 3: sliding-window and full layers, an image's tokens attending to each other both ways."""
    from transformers.models.gemma3 import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    names = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    tokenizer.add_special_tokens({"additional_special_tokens": list(names.values())})
    tokenizer._set_model_specific_special_tokens(
        special_tokens=names
    )  # what Gemma's tokenizer config declares
    template = VISION_CHATML.replace("{{ IMAGE }}", "<start_of_image>")
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        image_seq_length=4,
        chat_template=template,
    )
    text = {k: v for k, v in TEXT.items() if k != "num_hidden_layers"} | _SLIDING
    config = Gemma3Config(
        text_config=text
        | dict(
            query_pre_attn_scalar=16,
            vocab_size=len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=4,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    return config, [processor], template


VISION_ARCHITECTURES = {
    "qwen2_5_vl": _qwen2_5_vl,
    "idefics3": _idefics3,
    "qwen3_5": _qwen3_5,
    "gemma3": _gemma3,
}


def build_vision(arch: str, folder: Path, tokenizer, seed: int = 0) -> Path:
    """Save a tiny random vision model of `arch` as transformers would (its image-text-to-text class),
    with `tokenizer` plus the architecture's image tokens, an image processor and a chat template
    that places images: what the model's processor loads from."""
    from transformers import AutoModelForImageTextToText

    config, parts, template = VISION_ARCHITECTURES[arch](copy.deepcopy(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    projector = getattr(model.model, "multi_modal_projector", None)
    if hasattr(
        projector, "mm_input_projection_weight"
    ):  # Gemma 3 starts it at zeros: images would not matter
        torch.nn.init.normal_(projector.mm_input_projection_weight, std=0.2)
    model.save_pretrained(folder)
    for part in parts:
        part.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


def save_lora_adapter(
    base_dir: Path, folder: Path, rank: int, targets: list[str], seed: int
) -> Path:
    """A PEFT LoRA adapter of `rank` on the model in `base_dir`, with random weights (strong
    enough to change greedy tokens), saved as PEFT saves one."""
    from peft import LoraConfig, get_peft_model  # the test extra's; only these tests need it

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
    )
    peft = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    peft.save_pretrained(folder)
    return folder
