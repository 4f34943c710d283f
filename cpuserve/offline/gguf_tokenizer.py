"""A `tokenizer.json` rebuilt from a GGUF vocabulary, splitting text the way llama.cpp does.

llama.cpp names the pre-tokenizer (`tokenizer.ggml.pre`) rather than storing it; each name maps
to the regex sequence llama.cpp applies, expressed with the `tokenizers` library's pieces.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from cpuserve.errors import CheckpointError

# GGUF token types (llama.cpp's llama_token_type)
CONTROL, USER_DEFINED = 3, 4

_GPT2_PRES = ("default", "gpt2", "mpt", "olmo", "jais")
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral")
_QWEN2_PRES = ("qwen2", "deepseek-r1-qwen", "megrez")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level_plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _GPT2_PRES:
        return byte_level_regex
    if pre in _DIGIT_SPLIT_PRES:
        # Every digit is its own piece, then the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level_regex])
    for names, regex in ((_LLAMA3_PRES, _LLAMA3_SPLIT), (_QWEN2_PRES, _QWEN2_SPLIT)):
        if pre in names:
            return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"), byte_level_plain])
    supported = _GPT2_PRES + _DIGIT_SPLIT_PRES + _LLAMA3_PRES + _QWEN2_PRES
    raise CheckpointError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(supported)})")


def build_tokenizer(meta: dict[str, Any], source: str) -> Tokenizer:
    """The byte-level BPE tokenizer a GGUF's `tokenizer.ggml.*` metadata describes."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported (expected 'gpt2', byte-level BPE)"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    merges: list[str] = meta.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), source)
    tok.decoder = decoders.ByteLevel()
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{source}: tokenizer.ggml.token_type has {len(types)} entries, expected {len(tokens)} (one per token)"
        )
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in kinds if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in kinds if ty == USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        bos_tok = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B", special_tokens=[(bos_tok, bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok
