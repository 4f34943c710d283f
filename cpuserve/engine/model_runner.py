"""Turns a scheduled batch into one flat forward pass, then samples it: ScheduledBatch in,
StepOutput (drawn tokens, prompt logprobs) out. The runner owns the tensors (KV cache, logits);
the scheduler owns the sequences' state and is told what came out."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpuserve.engine.paged_attention import AttentionMetadata, PagedAttention, PagedKVCache, PrefillChunk
from cpuserve.engine.pooling import PoolState
from cpuserve.engine.sampler import logprob_entries, sample
from cpuserve.engine.scheduler import Sampled, ScheduledBatch, StepOutput
from cpuserve.engine.structured import MaskComputer
from cpuserve.model.decoder import CausalLM


@dataclass
class StepLogits:
    """fp32 logits: the sampled rows of every item that samples, and per-position rows for prompt logprobs."""

    sample_logits: torch.Tensor | None  # [sum of num_sampled, V], items in batch order
    samplers: list[int]  # one entry per row of sample_logits: its index into batch.items
    prompt_logits: dict[int, torch.Tensor]  # batch index -> [n, V] for the chunk's positions
    pooled: dict[int, list[float]] = field(default_factory=dict)  # batch index -> a finished embedding


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        eos_ids: frozenset[int] = frozenset(),
        kv_storage: str | None = None,
    ) -> None:
        """kv_storage: what the KV cache holds (kv_cache_dtype.kv_cache_storage): "int8", "bfloat16",
        "float16", or None for the model's dtype."""
        spec = model.spec
        self.model = model
        self.eos_ids = set(eos_ids)
        int8 = kv_storage == "int8"
        stored = model.dtype if kv_storage is None or int8 else getattr(torch, kv_storage)
        self.cache = PagedKVCache(
            spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, stored, int8=int8
        )
        self._masks: MaskComputer | None = None  # made when the first constrained row samples

    @property
    def masks(self) -> MaskComputer:
        if self._masks is None:
            self._masks = MaskComputer(self.model.spec.vocab_size)
        return self._masks

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
    def execute_model(self, batch: ScheduledBatch) -> StepOutput:
        """The forward pass, then one draw per sampled row and the prompt logprobs asked for. A
        fault in one item's sampling or logprobs is that item's (in the output); a fault in the
        forward pass is the batch's and propagates. The grammar masks of constrained rows are
        computed on another thread while the forward pass runs."""
        constrained = [
            i
            for i, (seq, _) in enumerate(batch.items)
            if batch.num_sampled[i] and seq.grammar is not None and seq.grammar.active
        ]
        pending = self.masks.start([batch.items[i][0].grammar for i in constrained]) if constrained else None
        logits = self.execute(batch)
        out = StepOutput()
        for i, vec in logits.pooled.items():
            out.pooled[i] = vec
        for i, rows in logits.prompt_logits.items():
            seq = batch.items[i][0]
            try:
                out.prompt_logprobs[i] = (seq.num_computed + 1, self._prompt_logprobs(seq, rows))
            except Exception as exc:
                out.errors[i] = exc
        if logits.samplers:
            seqs = [batch.items[i][0] for i in logits.samplers]
            draws = sample(logits.sample_logits, seqs, self.eos_ids, self._grammar_masks(pending, constrained, logits))
            for i, drawn in zip(logits.samplers, draws, strict=True):
                out.sampled.setdefault(i, []).append(drawn if isinstance(drawn, Exception) else Sampled(*drawn))
        return out

    @staticmethod
    def _grammar_masks(pending, constrained: list[int], logits: StepLogits) -> list | None:  # type: ignore[no-untyped-def]
        """One grammar mask (or the fault computing them raised, or None) per sampled row."""
        if pending is None:
            return None
        try:
            rows: dict[int, torch.Tensor | Exception] = dict(zip(constrained, pending.result(), strict=True))
        except Exception as exc:
            rows = dict.fromkeys(constrained, exc)
        if len(logits.samplers) != len(set(logits.samplers)) and rows:
            several = NotImplementedError("a grammar mask covers one sampled position per sequence and step")
            rows = dict.fromkeys(rows, several)  # those requests fail alone; the engine goes on
        return [rows.get(i) for i in logits.samplers]

    @staticmethod
    def _prompt_logprobs(seq, rows: torch.Tensor) -> list:  # type: ignore[no-untyped-def]
        """Entries for prompt positions num_computed + 1 ... (position p predicts prompt token p)."""
        start = seq.num_computed + 1
        tokens = list(seq.prompt_ids[start : start + rows.shape[0]])
        return logprob_entries(rows, tokens, [seq.params.prompt_logprobs or 0] * len(tokens))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        """The forward pass and the logits the step needs (no sampling)."""
        input_ids, positions, meta = self._metadata(batch)
        hidden = self.model.forward_tokens(input_ids, positions, PagedAttention(self.cache, meta))
        samplers, rows, prompt_logits = [], [], {}
        num_sampled = batch.num_sampled
        row = 0
        pooled: dict[int, list[float]] = {}
        for i, (seq, n) in enumerate(batch.items):
            if seq.params.pooling is not None:
                pooled_vec = self._pool(seq, hidden[row : row + n])
                if pooled_vec is not None:
                    pooled[i] = pooled_vec
            k = min(num_sampled[i], n)
            samplers.extend([i] * k)
            rows.extend(range(row + n - k, row + n))
            if seq.params.prompt_logprobs is not None and seq.index == 0 and seq.num_computed < len(seq.prompt_ids):
                # Position p predicts prompt token p + 1; the last prompt position predicts the first output.
                last = min(seq.num_computed + n, len(seq.prompt_ids) - 1)
                if last > seq.num_computed:
                    prompt_logits[i] = self.model.logits(hidden[row : row + last - seq.num_computed])
            row += n
        sample_logits = self.model.logits(hidden[rows]) if rows else None
        return StepLogits(sample_logits, samplers, prompt_logits, pooled)

    @staticmethod
    def _pool(seq, hidden: torch.Tensor) -> list[float] | None:  # type: ignore[no-untyped-def]
        """Fold a chunk's hidden states into the sequence's pool; the vector once the prompt is done."""
        if seq.pool is None:
            seq.pool = PoolState()
        seq.pool.add(hidden, seq.num_computed)
        if seq.num_computed + hidden.shape[0] < len(seq.prompt_ids):
            return None
        return seq.pool.result(seq.params.pooling, seq.params.normalize).tolist()
