"""Constraints compiled into grammars against the model's tokenizer, once each.

llguidance (the `guidance` backend of vLLM) does the work: it is a small dependency-free wheel for
x86-64 and aarch64; a 30-property schema compiles in 1.5-1.7 ms and one decode step's masks for 8
rows take 0.12-0.28 ms (`cpuserve bench structured`, AVX-512 VNNI host, docs/benchmarks.md), so
nothing heavier (xgrammar needs transformers and triton at run time) earns its place. A compiled
grammar is kept in an LRU cache keyed by the constraint; each sequence gets a cheap copy of its
matcher. Compilation errors are the request's: InvalidRequest naming the field the constraint came
from.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
from llguidance import LLMatcher, LLTokenizer

from cpuserve.engine.sampling_params import InvalidRequest
from cpuserve.engine.structured.matcher import GrammarState
from cpuserve.engine.structured.regex_classes import ascii_classes, ascii_schema_patterns
from cpuserve.engine.structured.spec import StructuredOutputs

CACHE_SIZE = 256
# JSON is written compactly, with the spacing json.dumps uses: a small model given free whitespace
# can spend its whole budget on newlines; every byte it may write is still valid JSON.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class CompiledGrammar:
    """A grammar ready to constrain sequences: each gets its own matcher (a copy of this one)."""

    def __init__(self, spec: StructuredOutputs, matcher: LLMatcher, tokenizer: LLTokenizer) -> None:
        self.spec, self._matcher, self._tokenizer = spec, matcher, tokenizer

    def new_state(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy(), self.spec.after.encode(), self._token_bytes)

    def _token_bytes(self, token: int) -> bytes:
        return self._tokenizer.decode_bytes([token])


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe (requests are compiled on worker threads)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int], cache_size: int = CACHE_SIZE):
        self._tokenizer_json, self.vocab_size = tokenizer_json, vocab_size
        self._eos = sorted(eos_ids)
        self._tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutputs, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.compiled = 0  # grammars built (cache misses)

    @property
    def tokenizer(self) -> LLTokenizer:
        """The token trie llguidance masks with: built on first use (about 0.2 s for a 49k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._tokenizer

    def prepare_in_background(self) -> None:
        """Build the token trie on a daemon thread now, so the first constrained request does not wait for it."""
        threading.Thread(target=lambda: self.tokenizer, name="cpuserve-grammar-trie", daemon=True).start()

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        grammar = self._grammar_text(spec)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(spec.param, f"the {spec.kind} constraint does not compile: {matcher.get_error()}")
        compiled = CompiledGrammar(spec, matcher, self.tokenizer)
        with self._lock:
            self.compiled += 1
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _grammar_text(spec: StructuredOutputs) -> str:
        """llguidance's grammar for a constraint; malformed input raises InvalidRequest."""
        try:
            if spec.kind == "json":
                schema = json.dumps(ascii_schema_patterns(json.loads(str(spec.value))))
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if spec.kind == "regex":
                return LLMatcher.grammar_from_regex(ascii_classes(str(spec.value)))
            if spec.kind == "choice":
                return llguidance.grammar_from("choice", json.dumps(list(spec.value)))
            if spec.kind == "grammar":
                return llguidance.grammar_from("grammar", str(spec.value))
            return _structural_tag_grammar(json.loads(str(spec.value)))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise InvalidRequest(spec.param, f"the {spec.kind} constraint is malformed: {exc}") from None


def _structural_tag_grammar(tag: dict) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}): free
    text in which each trigger starts a tagged segment whose body is held to its schema."""
    triggers = tag.get("triggers")
    structures = tag.get("structures")
    if not isinstance(triggers, list) or not triggers or not isinstance(structures, list) or not structures:
        raise ValueError("a structural tag needs non-empty 'structures' and 'triggers' lists")
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise ValueError("each structure needs string 'begin' and 'end'")
        begin = s["begin"]
        trigger = next((t for t in triggers if isinstance(t, str) and t and begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structure begin {begin!r} starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=s.get("schema", {}), end=s["end"]))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)
