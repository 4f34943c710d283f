"""One sequence's place in its grammar: the tokens it has drawn, consumed in order.

The scheduler feeds every drawn token in (`observe`); the runner asks the state for the next mask.
A state with an `after` marker stays inactive (no mask, nothing consumed) until the output's bytes
contain it: a reasoning model thinks freely, then its answer is held to the constraint. The marker
is looked for in text, not token ids: a tokenizer merges `</think>` differently after different
text, and a sampling model may spell it in any pieces.
"""

from __future__ import annotations

from collections.abc import Callable

from llguidance import LLMatcher


class GrammarRejected(RuntimeError):
    """A drawn token the grammar does not accept, or a grammar in error: a fault of this request alone."""


class GrammarState:
    def __init__(
        self, matcher: LLMatcher, after: bytes = b"", token_bytes: Callable[[int], bytes] | None = None
    ) -> None:
        self.matcher, self.after = matcher, after
        self.active = not after
        self._token_bytes = token_bytes
        self._tail = b""

    def observe(self, token: int) -> None:
        """The sequence drew `token`: advance the grammar (or watch for the marker that starts it)."""
        if not self.active:
            assert self._token_bytes is not None
            self._tail += self._token_bytes(token)
            self.active = self.after in self._tail
            self._tail = self._tail[-len(self.after) :]
            return
        if not self.matcher.consume_token(token):
            raise GrammarRejected(f"the grammar rejected token {token}: {self.matcher.get_error()}")

    def check(self) -> None:
        """Raise if the grammar is in error (then its mask would allow only the end of sequence)."""
        if self.matcher.is_error():
            raise GrammarRejected(f"the grammar failed: {self.matcher.get_error()}")

    @property
    def terminated(self) -> bool:
        """The constrained output is complete: no token but the end of sequence may follow."""
        return self.active and self.matcher.is_stopped()
