"""Incremental detokenization that never emits half a UTF-8 character.

Decoding token by token breaks multi-byte characters and byte-fallback pieces; decoding a short
window of recent tokens and emitting only the settled difference does not (as vLLM does).
"""

from __future__ import annotations

from cpuserve.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back the text they complete."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-6:])  # context so the first token decodes with its leading space
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The new text settled by token_id (possibly empty while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]
