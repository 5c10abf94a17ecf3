"""Which of a hub repo's files a model needs: its config, tokenizer and chat template, an embedding
model's sentence-transformers modules (`modules.json`, `1_Pooling/config.json` …), and its weights
in one format (safetensors, else PyTorch .bin), or the one .gguf file it runs from. Other files in
subfolders (onnx/, original/ …) are other formats of the same weights, never needed."""

import re

from shared.errors import InvalidRequest

SIDE_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
        "processor_config.json",
        "video_preprocessor_config.json",
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
    }
)
MODULE_CONFIG = re.compile(
    r"^\d+_\w+/config\.json$"
)  # a sentence-transformers module's (1_Pooling/config.json)
WEIGHT_FORMATS = (
    (".safetensors", "model.safetensors.index.json"),
    (".bin", "pytorch_model.bin.index.json"),
)


def needed_files(
    repo_files: list[str], gguf_file: str | None = None, source: str = ""
) -> list[str]:
    """The names to fetch, sorted; InvalidRequest when the repo has no weights Cortex can run, or
    several .gguf files and the catalogue names none (`gguf_file`)."""
    top = [name for name in repo_files if "/" not in name]
    side = [name for name in top if name in SIDE_FILES] + [
        name for name in repo_files if MODULE_CONFIG.match(name)
    ]
    ggufs = sorted(name for name in top if name.endswith(".gguf"))
    if gguf_file:
        if gguf_file not in ggufs:
            raise InvalidRequest(
                f"{source}: the catalogue's gguf_file {gguf_file!r} is not in the repo "
                f"(it has {', '.join(ggufs) or 'no .gguf files'})"
            )
        return sorted([*side, gguf_file])
    for suffix, index in WEIGHT_FORMATS:
        weights = [name for name in top if name.endswith(suffix) or name == index]
        if weights:
            return sorted([*side, *weights])
    if len(ggufs) == 1:
        return sorted([*side, *ggufs])
    if ggufs:
        raise InvalidRequest(
            f"{source} has {len(ggufs)} .gguf files ({', '.join(ggufs)}): name one with gguf_file "
            "in the catalogue"
        )
    raise InvalidRequest(
        f"{source} has no weights Cortex can load (.safetensors, .bin or .gguf at its top level)"
    )
