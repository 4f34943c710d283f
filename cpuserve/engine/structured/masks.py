"""The step's grammar masks, computed on a worker thread while the forward pass runs.

llguidance fills one bit per token for every constrained row that samples this step, and numpy
unpacks the bits into one bool row of forbidden tokens per sequence; both let go of the GIL, as
the native decode step does, so this thread runs beside the model's. (numpy, not torch: a torch op
on a second thread would start an OpenMP team of its own on the cores the model is using.) The
sampler applies each row last, as it does allowed_token_ids. Rows without a constraint are not
looked at.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from llguidance import LLExecutor

from cpuserve.engine.structured.matcher import GrammarState


def unpack_bitmask(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 [R, ceil(V / 32)] (bit j of word w: token 32 w + j allowed) -> bool [R, V], allowed."""
    little = bits.astype("<i4", copy=False)  # bit j of a word is bit j % 8 of its byte j // 8
    return np.unpackbits(little.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].astype(bool)


def _error(state: GrammarState) -> Exception | None:
    try:
        state.check()
    except Exception as exc:
        return exc
    return None


class MaskComputer:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpuserve-grammar")
        self._executor = LLExecutor(num_threads=1)

    def start(self, states: list[GrammarState]) -> Future:  # type: ignore[type-arg]
        """Begin computing the masks of `states` (all active); the future gives bool [len(states), V],
        True where a token is forbidden (or, when a grammar is in error, one row or error per state)."""
        return self._pool.submit(self._compute, list(states))

    def compute(self, states: list[GrammarState]) -> torch.Tensor:
        """The same, on the calling thread."""
        return self._compute(states)

    def _compute(self, states: list[GrammarState]) -> torch.Tensor:
        bits = np.full((len(states), self.words), -1, dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(s.matcher, i) for i, s in enumerate(states)], bits.ctypes.data, self.words * 4, len(states)
        )
        forbidden = torch.from_numpy(~unpack_bitmask(bits, self.vocab_size))
        errors = {i: exc for i, s in enumerate(states) if (exc := _error(s)) is not None}
        return forbidden if not errors else [errors.get(i, forbidden[i]) for i in range(len(states))]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
