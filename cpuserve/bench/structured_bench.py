"""`cpuserve bench structured`: what holding the output to a JSON schema costs, measured in one run
on one engine.

Structured outputs add work in three places: compiling the schema when a request arrives
(llguidance, cached by constraint), computing every constrained row's token mask each step (on a
worker thread, meant to hide behind the forward pass), and applying the masks and advancing the
grammars on the engine thread. This benchmark puts a number on each: decode throughput with every
row constrained against the same prompts unconstrained (alternating order, medians of repeats);
the cold and cached compile time of a 30-property schema (the one-time token-trie build apart);
the mask time per step and how much of it the forward pass hides. Nothing in the engine changes:
its runner, its mask computer, the sampler and the grammar state are wrapped for the timed runs and
restored after. xgrammar's compile and mask times on the same schemas and token traces are added
when it is importable (it is not a dependency).

A throughput ratio means something only if both sides generate the same number of tokens: every request
ignores EOS, and the decode schema is an array of records whose minItems makes its shortest JSON
longer than new_tokens times the longest token of the vocabulary, so no constrained row can finish
(nor be allowed EOS) before max_tokens. The counts are reported and checked.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import cpuserve.engine.model_runner as model_runner_module
from cpuserve.engine import LLMEngine, SamplingParams, StructuredOutputs
from cpuserve.engine.structured import GrammarState, MaskComputer
from cpuserve.tokenizer import Tokenizer

# One record of the decode schema: every field required, so each item is keys, numbers, a short
# string, a boolean and an enum in turn (mask work like a real extraction schema's, not one long string).
ITEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 16},
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]},
        "score": {"type": "number"},
    },
    "required": ["id", "name", "ok", "level", "score"],
    "additionalProperties": False,
}
STALL_MARGIN_S = 1e-3  # masks ready this close to the layers' end count as having waited for them
COLD_SCHEMAS = 3  # fresh 30-property schemas compiled cold (at least; more with more repeats)


# ---- schemas (pure) ----------------------------------------------------------------------------------


def min_json_bytes(schema: dict[str, Any]) -> int:
    """A lower bound on the UTF-8 length of any JSON text valid under `schema` (the subset the bench
    uses: object, array, string, integer, number, boolean, null, enum, const; 0 for anything else).
    Separators count one byte, so the bound holds with or without whitespace."""
    if "const" in schema:
        return _dumps_len(schema["const"])
    if "enum" in schema:
        return min(_dumps_len(v) for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return min(min_json_bytes({**schema, "type": k}) for k in kind) if kind else 0
    if kind == "string":
        return 2 + int(schema.get("minLength", 0))
    if kind in ("integer", "number"):
        return 1
    if kind in ("boolean", "null"):
        return 4  # true, null (false is longer)
    if kind == "object":
        props = schema.get("properties", {})
        required = schema.get("required", [])
        members = [_dumps_len(k) + 1 + min_json_bytes(props.get(k, {})) for k in required]
        return 2 + sum(members) + max(0, len(members) - 1)
    if kind == "array":
        n = int(schema.get("minItems", 0))
        return 2 + n * min_json_bytes(schema.get("items", {})) + max(0, n - 1)
    return 0


def _dumps_len(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def min_items_for(item_schema: dict[str, Any], budget_bytes: int) -> int:
    """The fewest array items whose shortest JSON array is longer than `budget_bytes`."""
    item = min_json_bytes(item_schema)
    if item < 1:
        raise ValueError("the item schema has no positive minimum length")
    # 2 + n * item + (n - 1) > budget  <=>  n > (budget - 1) / (item + 1)
    return max(1, (budget_bytes - 1) // (item + 1) + 1)


def decode_schema(new_tokens: int, max_token_bytes: int) -> dict[str, Any]:
    """An array of ITEM_SCHEMA records that `new_tokens` tokens of at most `max_token_bytes` bytes
    each cannot complete: the constrained rows run to max_tokens, as the unconstrained ones do."""
    n = min_items_for(ITEM_SCHEMA, new_tokens * max_token_bytes)
    return {"type": "array", "items": ITEM_SCHEMA, "minItems": n}


def wide_schema(tag: str) -> dict[str, Any]:
    """A 30-property object schema of mixed types (8 strings, 6 integers, 5 numbers, 4 booleans,
    4 enums, 2 arrays, 1 nested object; 20 required). `tag` is in every property name, so each tag
    is a schema no cache has seen."""
    s = {"type": "string"}
    props: dict[str, dict[str, Any]] = {
        "title": {**s, "maxLength": 40},
        "author": {**s, "maxLength": 24},
        "summary": {**s, "maxLength": 120},
        "city": {**s, "maxLength": 20},
        "country": {**s, "maxLength": 20},
        "isbn": {**s, "pattern": "^[0-9]{3}-[0-9]{10}$"},
        "language": {**s, "minLength": 2, "maxLength": 8},
        "notes": s,
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "pages": {"type": "integer", "minimum": 1},
        "edition": {"type": "integer", "minimum": 1, "maximum": 20},
        "copies": {"type": "integer", "minimum": 0},
        "rank": {"type": "integer"},
        "votes": {"type": "integer", "minimum": 0},
        "price": {"type": "number", "minimum": 0},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "weight": {"type": "number"},
        "width": {"type": "number"},
        "height": {"type": "number"},
        "in_print": {"type": "boolean"},
        "signed": {"type": "boolean"},
        "hardcover": {"type": "boolean"},
        "illustrated": {"type": "boolean"},
        "genre": {"enum": ["fiction", "history", "science", "poetry", "travel"]},
        "condition": {"enum": ["new", "good", "fair", "poor"]},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "binding": {"type": "string", "enum": ["paper", "cloth", "leather"]},
        "tags": {"type": "array", "items": {**s, "maxLength": 16}, "maxItems": 5},
        "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
        "publisher": {
            "type": "object",
            "properties": {
                "name": {**s, "maxLength": 30},
                "founded": {"type": "integer", "minimum": 1400},
                "city": {**s, "maxLength": 20},
                "public": {"type": "boolean"},
            },
            "required": ["name", "founded"],
            "additionalProperties": False,
        },
    }
    optional = {"notes", "rank", "weight", "width", "height", "illustrated", "copies", "votes", "tags", "signed"}
    return {
        "type": "object",
        "properties": {f"{k}_{tag}": v for k, v in props.items()},
        "required": [f"{k}_{tag}" for k in props if k not in optional],
        "additionalProperties": False,
    }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list; 0.0 for an empty one."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def max_token_bytes(tokenizer: Tokenizer, vocab_size: int) -> int:
    """The longest token of the vocabulary, in bytes (specials as their text)."""
    return max(len(tokenizer.token_bytes(i)) for i in range(vocab_size))


def _prompt(i: int) -> str:
    return (
        f"Catalogue {i}. Write the catalogue as a JSON array of records; each record has an id, a name, "
        "ok (true or false), a level (low, mid or high) and a score.\n"
    )


# ---- instrumentation ----------------------------------------------------------------------------------


@dataclass
class StepTimes:
    """Where one engine step's time went (perf_counter seconds; timestamps are absolute)."""

    step_s: float = 0.0
    forward_s: float = 0.0  # ModelRunner.execute: the forward pass and the logits
    forward_end: float = 0.0
    body_end: float = 0.0  # the model's layers done, the lm head (model.logits) starting
    sample_s: float = 0.0  # the sampler, masks applied
    rows: int = 0  # constrained rows masked this step
    mask_begin: float = 0.0  # MaskComputer._compute on its worker thread
    mask_end: float = 0.0
    fill_s: float = 0.0  # of which llguidance filling the bitmask (the rest: int32 bits -> bool rows)
    wait_s: float = 0.0  # the engine thread blocked on the masks after the forward pass
    observe_s: float = 0.0  # GrammarState.observe (the scheduler advancing the grammars)

    @property
    def mask_s(self) -> float:
        return self.mask_end - self.mask_begin if self.rows else 0.0

    @property
    def gil_stalled(self) -> bool:
        """The masks came only as the layers finished: the worker waited out the forward pass for
        the GIL (a native call that keeps it) instead of running beside it."""
        return bool(self.rows and self.body_end and self.mask_end >= self.body_end - STALL_MARGIN_S)

    @property
    def late_s(self) -> float:
        """How long after the forward pass ended the masks were ready (0: fully hidden)."""
        return max(0.0, self.mask_end - self.forward_end) if self.rows else 0.0


class _TimedExecutor:
    """Stands in for MaskComputer's LLExecutor, timing the bitmask fill."""

    def __init__(self, inner: Any, probe: Probe) -> None:
        self._inner, self._probe = inner, probe

    def unsafe_compute_mask_ptr(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._inner.unsafe_compute_mask_ptr(*args)
        finally:
            if (rec := self._probe.current) is not None:
                rec.fill_s += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Probe:
    """Times the pieces of each engine step by wrapping (never replacing the logic of) the runner's
    execute and _grammar_masks, its MaskComputer, the model's logits (where its layers end), the
    runner's sampler and GrammarState.observe.
    `current` is the step being timed; steps outside begin()/end() pass through untimed."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.current: StepTimes | None = None

    def begin(self) -> StepTimes:
        self.current = StepTimes()
        return self.current

    def end(self) -> None:
        self.current = None

    @contextmanager
    def installed(self) -> Iterator[Probe]:
        runner, model = self.engine.core.runner, self.engine.model
        masks = runner.masks  # made now (lazily otherwise), so its methods can be wrapped
        orig_execute, orig_grammar_masks = runner.execute, runner._grammar_masks
        orig_compute, orig_executor = masks._compute, masks._executor
        orig_sample, orig_observe = model_runner_module.sample, GrammarState.observe
        orig_logits = model.logits
        probe = self

        def logits(hidden: Any) -> Any:
            if (rec := probe.current) is not None and not rec.body_end:
                rec.body_end = time.perf_counter()
            return orig_logits(hidden)

        def execute(batch: Any) -> Any:
            start = time.perf_counter()
            try:
                return orig_execute(batch)
            finally:
                if (rec := probe.current) is not None:
                    rec.forward_end = time.perf_counter()
                    rec.forward_s = rec.forward_end - start

        def grammar_masks(pending: Any, constrained: list[int], logits: Any) -> Any:
            if pending is not None and (rec := probe.current) is not None:
                start = time.perf_counter()
                futures.wait([pending])  # a fault is the original's to report, per row
                rec.wait_s = time.perf_counter() - start
            return orig_grammar_masks(pending, constrained, logits)

        def compute(states: list[GrammarState]) -> Any:
            begin = time.perf_counter()
            try:
                return orig_compute(states)
            finally:
                if (rec := probe.current) is not None:
                    rec.rows, rec.mask_begin, rec.mask_end = len(states), begin, time.perf_counter()

        def sample(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return orig_sample(*args, **kwargs)
            finally:
                if (rec := probe.current) is not None:
                    rec.sample_s += time.perf_counter() - start

        def observe(state: GrammarState, token: int) -> None:
            start = time.perf_counter()
            try:
                orig_observe(state, token)
            finally:
                if (rec := probe.current) is not None:
                    rec.observe_s += time.perf_counter() - start

        runner.execute, runner._grammar_masks = execute, grammar_masks
        masks._compute, masks._executor = compute, _TimedExecutor(orig_executor, self)
        model_runner_module.sample, GrammarState.observe = sample, observe
        model.logits = logits
        try:
            yield self
        finally:
            del runner.execute, runner._grammar_masks, masks._compute, model.logits
            masks._executor = orig_executor
            model_runner_module.sample, GrammarState.observe = orig_sample, orig_observe


# ---- decode runs ----------------------------------------------------------------------------------


@dataclass
class DecodeRun:
    constrained: bool
    decode_tokens: int  # tokens drawn in steps where every stream decodes (the timed ones)
    decode_seconds: float
    prefill_seconds: float
    generated: list[int]  # tokens each stream generated in all
    finish_reasons: list[str | None]
    errors: list[str]
    traces: list[list[int]] = field(repr=False)
    sample_text: str = ""
    steps: list[StepTimes] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def decode_run(
    engine: LLMEngine, probe: Probe, streams: int, new_tokens: int, spec: StructuredOutputs | None
) -> DecodeRun:
    """Prefill `streams` prompts, then time the steps in which every stream decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, structured_outputs=spec)
    ids = [f"structured-bench-{time.monotonic_ns()}-{i}" for i in range(streams)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, _prompt(i), params)
    sched = engine.scheduler
    finals: dict[str, Any] = {}
    steps: list[StepTimes] = []
    tokens, decode_s, prefill_s = 0, 0.0, 0.0
    while engine.has_unfinished():
        decoding = all(s.num_tokens - s.num_computed == 1 for s in sched.running) and not sched.waiting
        drawn_before = sched.num_generated_tokens
        rec = probe.begin()
        start = time.perf_counter()
        outs = engine.step()
        rec.step_s = time.perf_counter() - start
        probe.end()
        for out in outs:
            if out.finished:
                finals[out.request_id] = out
        if decoding and len(sched.running) + sum(o.finished for o in outs) == streams:
            tokens += sched.num_generated_tokens - drawn_before
            decode_s += rec.step_s
            steps.append(rec)
        else:
            prefill_s += rec.step_s
    done = [finals[rid] for rid in ids if rid in finals]
    return DecodeRun(
        constrained=spec is not None,
        decode_tokens=tokens,
        decode_seconds=decode_s,
        prefill_seconds=prefill_s,
        generated=[len(o.outputs[0].token_ids) for o in done],
        finish_reasons=[o.outputs[0].finish_reason for o in done],
        errors=[o.error for o in done if o.error],
        traces=[list(o.outputs[0].token_ids) for o in done],
        sample_text=done[0].outputs[0].text if done else "",
        steps=steps,
    )


def _ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(values) if values else 0.0, "p90_ms": 1e3 * percentile(values, 90)}


def _side(runs: list[DecodeRun]) -> dict[str, Any]:
    steps = [s for r in runs for s in r.steps]
    return {
        "tok_s": statistics.median(r.tok_s for r in runs),
        "tok_s_runs": [r.tok_s for r in runs],
        "step": _ms([s.step_s for s in steps]),
        "forward": _ms([s.forward_s for s in steps]),
        "sample": _ms([s.sample_s for s in steps]),
        "generated_tokens": [sum(r.generated) for r in runs],
        "per_stream_tokens": sorted({n for r in runs for n in r.generated}),
        "finish_reasons": sorted({str(f) for r in runs for f in r.finish_reasons}),
        "errors": [e for r in runs for e in r.errors],
        "decode_steps": len(steps),
    }


def _mask_stats(runs: list[DecodeRun]) -> dict[str, Any]:
    steps = [s for r in runs for s in r.steps if s.rows]
    total_mask = sum(s.mask_s for s in steps)
    total_late = sum(s.late_s for s in steps)
    return {
        "steps": len(steps),
        "rows": sorted({s.rows for s in steps}),
        "compute": _ms([s.mask_s for s in steps]),
        "fill": _ms([s.fill_s for s in steps]),
        "unpack": _ms([s.mask_s - s.fill_s for s in steps]),
        "late": _ms([s.late_s for s in steps]),
        "wait": _ms([s.wait_s for s in steps]),
        "observe": _ms([s.observe_s for s in steps]),
        "hidden_pct": 100.0 * (1 - total_late / total_mask) if total_mask else 0.0,
        "ready_before_forward_end_pct": 100.0 * sum(s.late_s == 0.0 for s in steps) / len(steps) if steps else 0.0,
        "gil_stalled_pct": 100.0 * sum(s.gil_stalled for s in steps) / len(steps) if steps else 0.0,
        "unstalled": _ms([s.mask_s for s in steps if not s.gil_stalled]),
    }


# ---- compile and offline mask timings -----------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def compile_timings(engine: LLMEngine, schemas: list[str]) -> dict[str, Any]:
    """The engine's GrammarCompiler on fresh 30-property schemas (cold), then the last one again
    (cached); the token trie it builds once is timed on its own first."""
    grammars = engine.grammars
    was_built = getattr(grammars, "_tokenizer", None) is not None
    _, trie_s = _timed(lambda: grammars.tokenizer)
    masks = MaskComputer(engine.vocab_size)
    cold, first_mask = [], []
    try:
        for text in schemas:
            before = grammars.compiled
            compiled, seconds = _timed(lambda t=text: grammars.compile(StructuredOutputs("json", t)))
            if grammars.compiled != before + 1:
                raise RuntimeError("a fresh schema was not compiled (a cache hit?)")
            cold.append(seconds)
            state = compiled.new_state()
            first_mask.append(_timed(lambda s=state: masks.compute([s]))[1])
        before = grammars.compiled
        _, cached_s = _timed(lambda: grammars.compile(StructuredOutputs("json", schemas[-1])))
        cache_hit = grammars.compiled == before
    finally:
        masks.shutdown()
    return {
        "tokenizer_ms": 1e3 * trie_s,
        "tokenizer_was_built": was_built,
        "cold_ms": [1e3 * s for s in cold],
        "cold_median_ms": 1e3 * statistics.median(cold),
        "first_mask_ms": [1e3 * s for s in first_mask],
        "first_mask_median_ms": 1e3 * statistics.median(first_mask),
        "cached_ms": 1e3 * cached_s,
        "cache_hit": cache_hit,
    }


def replay_llguidance(engine: LLMEngine, schema_text: str, traces: list[list[int]]) -> dict[str, Any]:
    """The masks of a constrained run's token traces recomputed with the engine idle (no forward
    pass competing for the cores): all rows per step, on the calling thread."""
    compiled = engine.grammars.compile(StructuredOutputs("json", schema_text))
    states = [compiled.new_state() for _ in traces]
    masks = MaskComputer(engine.vocab_size)
    times = []
    try:
        for k in range(min(len(t) for t in traces)):
            times.append(_timed(lambda: masks.compute(states))[1])
            for state, trace in zip(states, traces, strict=True):
                state.observe(trace[k])
    finally:
        masks.shutdown()
    return {"steps": len(times), "rows": len(traces), **_ms(times)}


def xgrammar_timings(
    tokenizer: Tokenizer, vocab_size: int, eos_ids: frozenset[int], schemas: list[str], decode_text: str, traces: list
) -> dict[str, Any]:
    """The same compile and mask timings with xgrammar, if it is importable (never a dependency)."""
    try:
        import xgrammar as xgr  # type: ignore[import-not-found]
    except ImportError:
        return {"available": False, "reason": "not installed"}
    try:

        def compile_json(text: str) -> Any:
            return compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))

        def make_compiler() -> Any:
            vocab = [tokenizer.token_bytes(i) for i in range(vocab_size)]
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=sorted(eos_ids))
            return xgr.GrammarCompiler(info)

        compiler, tokenizer_s = _timed(make_compiler)
        cold, first_mask = [], []
        for text in schemas:
            grammar, seconds = _timed(lambda t=text: compile_json(t))
            cold.append(seconds)
            matcher, bitmask = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab_size)
            first_mask.append(_timed(lambda m=matcher, b=bitmask: m.fill_next_token_bitmask(b, 0))[1])
        _, cached_s = _timed(lambda: compile_json(schemas[-1]))
        grammar = compile_json(decode_text)
        matchers = [xgr.GrammarMatcher(grammar) for _ in traces]
        bitmask = xgr.allocate_token_bitmask(len(traces), vocab_size)
        times, rejected = [], None
        for k in range(min(len(t) for t in traces)):
            start = time.perf_counter()
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
            times.append(time.perf_counter() - start)
            bad = [i for i, (m, t) in enumerate(zip(matchers, traces, strict=True)) if not m.accept_token(t[k])]
            if bad:
                rejected = f"row {bad[0]} token {traces[bad[0]][k]} at step {k}"
                break
        return {
            "available": True,
            "version": getattr(xgr, "__version__", "?"),
            "tokenizer_ms": 1e3 * tokenizer_s,
            "cold_median_ms": 1e3 * statistics.median(cold),
            "cold_ms": [1e3 * s for s in cold],
            "first_mask_median_ms": 1e3 * statistics.median(first_mask),
            "cached_ms": 1e3 * cached_s,
            "replay": {"steps": len(times), "rows": len(traces), **_ms(times), "rejected": rejected},
        }
    except Exception as exc:  # an API this code does not know: say so, the rest of the report stands
        return {"available": True, "error": f"{type(exc).__name__}: {exc}"}


# ---- the whole benchmark ----------------------------------------------------------------------------------


def run_structured_bench(engine: LLMEngine, streams: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Compile timings first (while the token trie is still cold), then decode runs alternating
    constrained/unconstrained, then the offline mask replays."""
    import llguidance

    nonce = time.monotonic_ns()
    wide = [StructuredOutputs.canonical_json(wide_schema(f"c{k}_{nonce}")) for k in range(max(COLD_SCHEMAS, repeats))]
    compiles = compile_timings(engine, wide)

    longest = max_token_bytes(engine.tokenizer, engine.vocab_size)
    schema = decode_schema(new_tokens, longest)
    text = StructuredOutputs.canonical_json(schema)
    spec = StructuredOutputs("json", text)
    probe = Probe(engine)
    runs: dict[bool, list[DecodeRun]] = {True: [], False: []}
    with probe.installed():
        decode_run(engine, probe, streams, 4, None)  # warm-up: both paths, the mask thread started
        decode_run(engine, probe, streams, 4, spec)
        for r in range(repeats):
            for constrained in (True, False) if r % 2 == 0 else (False, True):
                runs[constrained].append(decode_run(engine, probe, streams, new_tokens, spec if constrained else None))
    con, unc = _side(runs[True]), _side(runs[False])
    traces = runs[True][-1].traces
    expected = streams * new_tokens
    same = con["generated_tokens"] == unc["generated_tokens"] == [expected] * repeats
    return {
        "streams": streams,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "llguidance": llguidance.__version__,
        "decode_schema": {
            "min_items": schema["minItems"],
            "min_json_bytes": min_json_bytes(schema),
            "max_token_bytes": longest,
            "sample_output": runs[True][-1].sample_text[:160],
        },
        "decode": {
            "unconstrained": unc,
            "constrained": con,
            "ratio": con["tok_s"] / unc["tok_s"] if unc["tok_s"] else 0.0,
            "expected_tokens": expected,
            "same_token_count": same,
        },
        "compile": compiles,
        "masks": _mask_stats(runs[True]),
        "replay": replay_llguidance(engine, text, traces),
        "xgrammar": xgrammar_timings(engine.tokenizer, engine.vocab_size, engine.eos_ids, wide, text, traces),
    }


def render(result: dict[str, Any]) -> str:
    """The report as markdown tables."""
    host, d, c, m, x = result["host"], result["decode"], result["compile"], result["masks"], result["xgrammar"]
    xg_state = (
        f"xgrammar {x.get('version', '')}".strip()
        if x.get("available") and "error" not in x
        else f"xgrammar: {x.get('reason') or x.get('error')}"
    )
    ds = result["decode_schema"]
    lines = [
        f"model {result['model']}, {result['dtype']}, {host['threads']} threads",
        f"host {host['cpu']} ({host['arch']}), kernel ISA {host['isa']}",
        f"llguidance {result['llguidance']}; {xg_state}",
        "",
        f"Decode: {result['streams']} streams x {result['new_tokens']} new tokens, greedy, ignore_eos; "
        f"median of {result['repeats']} (constrained/unconstrained order alternating)",
        "",
        "| run | output tok/s | step ms (p90) | forward ms | sample ms | tokens generated | finish |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, side in (("unconstrained", d["unconstrained"]), ("JSON schema, every row", d["constrained"])):
        per = ",".join(str(n) for n in side["per_stream_tokens"])
        lines.append(
            f"| {label} | {side['tok_s']:.1f} | {side['step']['median_ms']:.2f} ({side['step']['p90_ms']:.2f}) | "
            f"{side['forward']['median_ms']:.2f} | {side['sample']['median_ms']:.2f} | "
            f"{'/'.join(str(n) for n in side['generated_tokens'])} ({per} per stream) | "
            f"{','.join(side['finish_reasons'])} |"
        )
    lines += [
        "",
        f"constrained / unconstrained: **{d['ratio']:.3f}x** ({100 * (1 - d['ratio']):.1f}% slower); "
        + (
            f"same token count in every run ({d['expected_tokens']})"
            if d["same_token_count"]
            else f"TOKEN COUNTS DIFFER (expected {d['expected_tokens']} per run): the ratio is not comparable"
        ),
        f"decode schema: array of 5-field records, minItems {ds['min_items']} (shortest JSON "
        f"{ds['min_json_bytes']} bytes > {result['new_tokens']} tokens x {ds['max_token_bytes']} bytes, "
        "the longest token)",
        f"constrained output begins: {ds['sample_output'][:100]!r}",
    ]
    errors = d["constrained"]["errors"] + d["unconstrained"]["errors"]
    if errors:
        lines.append(f"request errors: {errors[:3]}")

    def xv(key: str) -> str:
        return f"{x[key]:.3f}" if x.get("available") and key in x else "n/a"

    lines += [
        "",
        f"Grammar compile, 30-property schema (mixed types), median of {len(c['cold_ms'])} fresh schemas",
        "",
        "| | llguidance ms | xgrammar ms |",
        "|---|---|---|",
        f"| token trie, once per engine{' (was already built)' if c['tokenizer_was_built'] else ''} | "
        f"{c['tokenizer_ms']:.1f} | {xv('tokenizer_ms')} |",
        f"| cold compile, first request (the very first: {c['cold_ms'][0]:.3f}) | {c['cold_median_ms']:.3f} | "
        f"{xv('cold_median_ms')} |",
        f"| first mask of that grammar | {c['first_mask_median_ms']:.3f} | {xv('first_mask_median_ms')} |",
        f"| cached compile (same schema again){'' if c['cache_hit'] else ' MISS'} | "
        f"{c['cached_ms']:.4f} | {xv('cached_ms')} |",
    ]
    rows = ",".join(str(r) for r in m["rows"]) or "0"
    xr = x.get("replay") if x.get("available") else None
    xr_cell = "n/a" if not xr else f"{xr['median_ms']:.3f} | {xr['p90_ms']:.3f}"
    rp = result["replay"]
    lines += [
        "",
        f"Masks per decode step ({rows} constrained rows), {m['steps']} steps",
        "",
        "| | median ms | p90 ms |",
        "|---|---|---|",
        f"| MaskComputer wall, worker thread during the forward pass | {m['compute']['median_ms']:.3f} | "
        f"{m['compute']['p90_ms']:.3f} |",
        f"| the same, steps where it did not wait for the GIL | {m['unstalled']['median_ms']:.3f} | "
        f"{m['unstalled']['p90_ms']:.3f} |",
        f"| of which llguidance bitmask fill | {m['fill']['median_ms']:.3f} | {m['fill']['p90_ms']:.3f} |",
        f"| of which int32 bits -> bool rows | {m['unpack']['median_ms']:.3f} | {m['unpack']['p90_ms']:.3f} |",
        f"| masks ready after the forward pass ended (exposed) | {m['late']['median_ms']:.3f} | "
        f"{m['late']['p90_ms']:.3f} |",
        f"| engine thread waiting on the masks | {m['wait']['median_ms']:.3f} | {m['wait']['p90_ms']:.3f} |",
        f"| grammar advance (observe), engine thread | {m['observe']['median_ms']:.3f} | "
        f"{m['observe']['p90_ms']:.3f} |",
        f"| same traces replayed, engine idle (the mask work): llguidance | {rp['median_ms']:.3f} | "
        f"{rp['p90_ms']:.3f} |",
        f"| same traces replayed, engine idle: xgrammar | {xr_cell} |",
        "",
        f"hidden behind the forward pass: {m['hidden_pct']:.1f}% of mask wall time; masks ready before the "
        f"forward pass ended in {m['ready_before_forward_end_pct']:.0f}% of steps",
        f"in {m['gil_stalled_pct']:.0f}% of steps the masks came only as the model's layers finished (within "
        f"{STALL_MARGIN_S * 1e3:.0f} ms): the worker waited for the GIL the forward pass held, so the overlap "
        "there was with the lm head only",
    ]
    if xr and xr.get("rejected"):
        lines.append(f"xgrammar rejected the llguidance trace: {xr['rejected']}")
    return "\n".join(lines)


def result_json(result: dict[str, Any]) -> str:
    """The result as JSON text."""
    return json.dumps(result, indent=1)
