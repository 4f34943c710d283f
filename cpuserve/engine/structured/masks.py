"""The step's grammar masks, computed on a worker thread while the forward pass runs.

llguidance fills one bit per token for every constrained row that samples this step (releasing
the GIL, so the model's threads and this one overlap); the sampler then gets one bool row per
constrained sequence and applies it last, as it does allowed_token_ids. Rows without a
constraint are not looked at.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from llguidance import LLExecutor

from cpuserve.engine.structured.matcher import GrammarState

_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, ceil(V / 32)] (bit j of word w: token 32 w + j allowed) -> bool [R, V]."""
    return ((bits.unsqueeze(-1) >> _SHIFTS) & 1).to(torch.bool).flatten(1)[:, :vocab_size]


class MaskComputer:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpuserve-grammar")
        self._executor = LLExecutor(num_threads=1)

    def start(self, states: list[GrammarState]) -> Future[torch.Tensor]:
        """Begin computing the masks of `states` (all active); the future gives bool [len(states), V]."""
        return self._pool.submit(self._compute, list(states))

    def compute(self, states: list[GrammarState]) -> torch.Tensor:
        """The same, on the calling thread."""
        return self._compute(states)

    def _compute(self, states: list[GrammarState]) -> torch.Tensor:
        bits = np.full((len(states), self.words), -1, dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(s.matcher, i) for i, s in enumerate(states)], bits.ctypes.data, self.words * 4, len(states)
        )
        return unpack_bitmask(torch.from_numpy(bits), self.vocab_size)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
