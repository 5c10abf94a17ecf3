"""Constrained decoding with llguidance: a matcher per sequence whose request carries a grammar
(`SamplingParams.grammar`, built by the gateway), a token mask per step for those rows only,
and the chosen token fed back. Rows without a grammar cost nothing.

llguidance computes a row's mask in ~30-150 µs and ships no Hugging Face logits processor; its
per-sequence matchers fit this engine's batched loop, where every row may have its own grammar.
"""

import logging

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from transformers import PreTrainedTokenizerBase

from shared.errors import InvalidRequest

log = logging.getLogger(__name__)


class Grammars:
    """Per model: the llguidance view of its tokenizer (built on first use, ~1 s) and matchers."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: set[int]):
        self._hf, self.vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab_size, eos_token=self._eos
            )
        return self._tokenizer

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, llguidance.grammar_from("lark", grammar))
        if matcher.is_error():
            raise InvalidRequest(f"the output grammar cannot be used: {matcher.get_error()}")
        return matcher

    def bitmask(
        self, matchers: list[llguidance.LLMatcher | None], drafts: list[list[int]]
    ) -> tuple[torch.Tensor, list[int]] | None:
        """llguidance's packed mask of the tokens each row's grammar allows at each position it
        samples (its next token's, then after each of its `drafts` tokens, which the grammar
        allows), for the rows that have one, and those positions; None when no row has a grammar
        (node_agent/model/runner.py applies it). The matchers are left as they were."""
        starts = [sum(1 + len(d) for d in drafts[:i]) for i in range(len(drafts))]
        rows = [
            (m, draft, starts[i])
            for i, (m, draft) in enumerate(zip(matchers, drafts))
            if m is not None
        ]
        if not rows:
            return None
        positions = [start + j for _, draft, start in rows for j in range(len(draft) + 1)]
        bitmask = llguidance.torch.allocate_token_bitmask(len(positions), self.vocab_size)
        filled = 0
        for matcher, draft, _ in rows:
            for token in [*draft, None]:
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, filled)
                filled += 1
                if token is not None:
                    matcher.consume_token(token)
            if draft:
                matcher.rollback(len(draft))
        return bitmask, positions


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Feed the chosen token; False if the grammar refused it (it cannot, under its own mask)."""
    if matcher.consume_token(token):
        return True
    log.warning("grammar refused token %d: %s", token, matcher.get_error())
    return False
