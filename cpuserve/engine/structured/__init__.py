"""Structured outputs: constraints (spec), their compiled grammars (compiler), each sequence's
grammar state (matcher) and the per-step token masks (masks)."""

from cpuserve.engine.structured.compiler import CompiledGrammar, GrammarCompiler
from cpuserve.engine.structured.masks import MaskComputer, unpack_bitmask
from cpuserve.engine.structured.matcher import GrammarRejected, GrammarState
from cpuserve.engine.structured.spec import StructuredOutputs

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarRejected",
    "GrammarState",
    "MaskComputer",
    "StructuredOutputs",
    "unpack_bitmask",
]
