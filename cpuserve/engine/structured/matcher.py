"""One sequence's place in its grammar: the tokens it has drawn, consumed in order.

The scheduler feeds every drawn token in (`observe`); the runner asks the state for the next mask.
A state with `after_ids` stays inactive (no mask, nothing consumed) until the output ends with
them: a reasoning model thinks freely, then its answer is held to the constraint.
"""

from __future__ import annotations

from llguidance import LLMatcher


class GrammarRejected(RuntimeError):
    """A drawn token the grammar does not accept: a masking fault, never the client's."""


class GrammarState:
    def __init__(self, matcher: LLMatcher, after_ids: tuple[int, ...] = ()) -> None:
        self.matcher, self.after_ids = matcher, after_ids
        self.active = not after_ids
        self._tail: list[int] = []

    def observe(self, token: int) -> None:
        """The sequence drew `token`: advance the grammar (or watch for the marker that starts it)."""
        if not self.active:
            self._tail = [*self._tail, token][-len(self.after_ids) :]
            self.active = tuple(self._tail) == self.after_ids
            return
        if not self.matcher.consume_token(token):
            raise GrammarRejected(f"the grammar rejected token {token}: {self.matcher.get_error()}")

    @property
    def terminated(self) -> bool:
        """The constrained output is complete: no token but the end of sequence may follow."""
        return self.active and self.matcher.is_stopped()
