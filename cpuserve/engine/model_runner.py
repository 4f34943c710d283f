"""Turns a scheduled batch into one flat forward pass and returns the logits the step needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpuserve.engine.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache, PrefillChunk
from cpuserve.engine.scheduler import ScheduledBatch
from cpuserve.model.decoder import CausalLM


@dataclass
class StepLogits:
    """fp32 logits: one row per sampling sequence, and per-position rows for prompt logprobs."""

    sample_logits: torch.Tensor | None  # [len(samplers), V]
    samplers: list[int]  # indices into batch.items of sequences that sample this step
    prompt_logits: dict[int, torch.Tensor]  # batch index -> [n, V] for the chunk's positions


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int) -> None:
        spec = model.spec
        self.model = model
        self.cache = PagedKVCache(
            spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, model.dtype
        )
        self.gqa = spec.num_heads != spec.num_kv_heads

    def _metadata(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids, positions, slots = [], [], []
        decode_rows, decode_slots, prefills = [], [], []
        row = 0
        for seq, n in batch.items:
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_at(i) for i in range(start, end))
            positions.append(torch.arange(start, end))
            context = self.cache.slots(seq.block_table, 0, end)
            slots.append(context[start:end])
            if n == 1:
                decode_rows.append(row)
                decode_slots.append(context)
            else:
                prefills.append(PrefillChunk(slice(row, row + n), context, start))
            row += n
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            decode_rows=None,
            decode_slots=None,
            decode_lengths=None,
            prefills=prefills,
        )
        if decode_rows:
            longest = max(len(s) for s in decode_slots)
            padded = torch.empty(len(decode_slots), longest, dtype=torch.long)
            for i, s in enumerate(decode_slots):
                padded[i, : len(s)] = s
                padded[i, len(s) :] = s[0]  # a written slot: masked out, but never garbage (NaN x 0 = NaN)
            meta.decode_rows = torch.tensor(decode_rows)
            meta.decode_slots = padded
            meta.decode_lengths = torch.tensor([len(s) for s in decode_slots])
        return torch.tensor(ids), torch.cat(positions), meta

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        input_ids, positions, meta = self._metadata(batch)
        hidden = self.model.forward_tokens(input_ids, positions, PagedAttention(self.cache, meta, self.gqa))
        samplers, rows, prompt_logits = [], [], {}
        row = 0
        for i, (seq, n) in enumerate(batch.items):
            if seq.num_computed + n == seq.num_tokens:
                samplers.append(i)
                rows.append(row + n - 1)
            if seq.params.prompt_logprobs is not None and seq.index == 0 and seq.num_computed < len(seq.prompt_ids):
                # Position p predicts prompt token p + 1; the last prompt position predicts the first output.
                last = min(seq.num_computed + n, len(seq.prompt_ids) - 1)
                if last > seq.num_computed:
                    prompt_logits[i] = self.model.logits(hidden[row : row + last - seq.num_computed])
            row += n
        sample_logits = self.model.logits(hidden[rows]) if rows else None
        return StepLogits(sample_logits, samplers, prompt_logits)
