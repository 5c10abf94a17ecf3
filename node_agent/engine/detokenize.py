"""Incremental detokenisation that never emits half a UTF-8 character, and stop strings that are
matched across token boundaries and never emitted."""

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Decodes a growing list of ids into text deltas (the prefix/read offset scheme of TGI/vLLM).
    A tokenizer with a Rust backend runs the scheme there (`tokenizers`' DecodeStream, as vLLM v1
    does: ~3 µs a token against ~21 µs for two Python-level decodes); others decode in Python."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream(skip_special_tokens=True) if self.backend is not None else None
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        if self.stream is not None:
            return self.stream.step(self.backend, token_id) or ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""


class StopStrings:
    """Holds back text that could be the start of a stop string until it is known not to be."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched: str | None = None  # the stop string that was reached

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string was reached."""
        if not self.stops:
            return text, False
        buffer = self.held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            at = min(hits)
            self.matched = next(s for s in self.stops if buffer.find(s) == at)
            return buffer[:at], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if buffer.endswith(s[:k])), default=0)
        self.held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
