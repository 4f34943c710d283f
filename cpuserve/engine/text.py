"""Per-sequence output text: incremental detokenization and stop strings.

While a sequence runs, the last (longest stop string - 1) characters are held back, so a stop
string split across tokens is never streamed before it is recognised.
"""

from __future__ import annotations

from cpuserve.detokenizer import IncrementalDetokenizer
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.tokenizer import Tokenizer


class SequenceText:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""

    def add(self, token_id: int, may_stop: bool = True) -> str | None:
        """Append a token's text; return the stop string that ended the sequence, if one did.
        With may_stop False (min_tokens not reached yet) stop strings are not looked for."""
        start = len(self.text)
        self.text += self.detok.add(token_id)
        if not self.stops or not may_stop:
            return None
        # A stop string may begin up to holdback characters before the new text.
        search_from = max(0, start - self.holdback)
        found = [(at, stop) for stop in self.stops if (at := self.text.find(stop, search_from)) != -1]
        if not found:
            return None
        at, stop = min(found)  # the earliest stop string in the text wins
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        return stop

    def visible(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
