"""Fault injection for tests, without hooks in the product: requests carrying a marker seed fail at
a chosen place (detokenizing, sampling, or the batched forward pass, which is fatal)."""

from __future__ import annotations

SEED_DETOKENIZE_FAULT = 990001  # SequenceText.add raises from the third generated token on
SEED_SAMPLE_FAULT = 990002  # drawing a token raises
SEED_FATAL = 990003  # the model runner raises for the whole batch: the engine stops


def install(patch=setattr) -> None:  # type: ignore[no-untyped-def]
    """Patch the engine; pass pytest's monkeypatch.setattr to undo it after a test."""
    from cpuserve.engine import model_runner, sampler, text

    init, add = text.SequenceText.__init__, text.SequenceText.add
    draw, execute = sampler._draw, model_runner.ModelRunner.execute

    def recording_init(self, tokenizer, prompt_ids, params):  # type: ignore[no-untyped-def]
        init(self, tokenizer, prompt_ids, params)
        self.injected_seed, self.injected_count = params.seed, 0

    def faulty_add(self, token_id, *args):  # type: ignore[no-untyped-def]
        self.injected_count += 1
        if self.injected_seed == SEED_DETOKENIZE_FAULT and self.injected_count >= 3:
            raise UnicodeError("injected detokenizer fault")
        return add(self, token_id, *args)

    def faulty_draw(x, seq):  # type: ignore[no-untyped-def]
        if seq.params.seed == SEED_SAMPLE_FAULT:
            raise ValueError("injected sampling fault")
        return draw(x, seq)

    def faulty_execute(self, batch):  # type: ignore[no-untyped-def]
        if any(seq.params.seed == SEED_FATAL for seq, _ in batch.items):
            raise RuntimeError("injected fatal forward-pass fault")
        return execute(self, batch)

    patch(text.SequenceText, "__init__", recording_init)
    patch(text.SequenceText, "add", faulty_add)
    patch(sampler, "_draw", faulty_draw)
    patch(model_runner.ModelRunner, "execute", faulty_execute)
