"""A `tokenizer.json` rebuilt from a GGUF vocabulary, splitting text the way llama.cpp does.

Two vocabulary kinds (`tokenizer.ggml.model`):

- "gpt2", byte-level BPE: llama.cpp names the pre-tokenizer (`tokenizer.ggml.pre`) rather than
  storing it; each name maps to the regex sequence llama.cpp applies, expressed with the
  `tokenizers` library's pieces.
- "llama", SentencePiece: tokens with scores and no merges. llama.cpp merges the adjacent pair
  whose concatenation is the best-scoring token (leftmost first on a tie) until none is left,
  then spells characters it has no token for as `<0xNN>` byte tokens. That is BPE with every
  token's splits as merges ranked by the token's score, which is what is built here.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from cpuserve.errors import CheckpointError

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE = "\u2581"  # SentencePiece's stand-in for a space ("▁")

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
    """The tokenizer a GGUF's `tokenizer.ggml.*` metadata describes, as llama.cpp runs it."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        return _byte_level_bpe(meta, source)
    if kind == "llama":
        return _sentencepiece_bpe(meta, source)
    raise CheckpointError(
        f"{source}: tokenizer.ggml.model {kind!r} is not supported "
        "(expected 'gpt2', byte-level BPE, or 'llama', SentencePiece)"
    )


def special_token_flags(meta: dict[str, Any]) -> dict[str, bool]:
    """`add_bos_token` / `add_eos_token` as the built tokenizer applies them (for tokenizer_config.json).

    llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise; byte-level
    files keep the reading they always had (absent means no).
    """
    spm = meta.get("tokenizer.ggml.model") == "llama"
    return {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }


def _per_token(meta: dict[str, Any], key: str, tokens: list[str], source: str, default: Any = None) -> list[Any]:
    values = meta.get(key)
    if values is None and default is not None:
        return [default] * len(tokens)
    if values is None:
        raise CheckpointError(f"{source}: {key} is missing")
    if len(values) != len(tokens):
        raise CheckpointError(f"{source}: {key} has {len(values)} entries, expected {len(tokens)} (one per token)")
    return list(values)


def _byte_level_bpe(meta: dict[str, Any], source: str) -> Tokenizer:
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


def _score_merges(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, best-scoring result first.

    llama.cpp merges any adjacent pair whose concatenation is a token, the best score winning; a BPE
    merge list holding each token's splits at the token's score rank does the same. Equal scores
    (control tokens, byte tokens) fall back to the token id so the order is fixed.
    """
    ranked: list[tuple[float, int, int]] = []
    get = vocab.get
    for i, tok in enumerate(tokens):
        for cut in range(1, len(tok)):
            if get(tok[:cut]) is not None and get(tok[cut:]) is not None:
                ranked.append((-scores[i], i, cut))
    ranked.sort()
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]


def _sentencepiece_bpe(meta: dict[str, Any], source: str) -> Tokenizer:
    """SentencePiece as llama.cpp runs it (llm_tokenizer_spm): spaces become `▁`, an optional `▁` is put
    in front of every stretch of text between special tokens (`add_space_prefix`), the text is not
    split further, score-ranked merges, byte fallback; control / unknown tokens are special tokens and
    user-defined ones added tokens, matched in the raw text first."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens is missing")
    scores = [float(s) for s in _per_token(meta, "tokenizer.ggml.scores", tokens, source)]
    types = _per_token(meta, "tokenizer.ggml.token_type", tokens, source, default=NORMAL)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        # The model would have ids no text maps back to; a tokenizer.json cannot hold them.
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens lists {dup!r} more than once")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_score_merges(tokens, scores, vocab),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default for spm
    to_space = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), to_space]) if space_prefix else to_space
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    # Decoding drops the one space encoding put in front, so the text comes back exactly.
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in kinds if ty in (CONTROL, UNKNOWN)]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in kinds if ty == USER_DEFINED])
    tok.post_processor = _bos_eos_processor(meta, tokens)
    return tok


def _bos_eos_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    """BOS in front and / or EOS behind each sequence, as the file's add_*_token flags ask."""
    flags = special_token_flags(meta)
    ends: list[tuple[str, int]] = []
    for which in ("bos", "eos"):
        idx = meta.get(f"tokenizer.ggml.{which}_token_id")
        if flags[f"add_{which}_token"] and idx is not None and 0 <= idx < len(tokens):
            ends.append((which, idx))
    if not ends:
        return None
    named = dict(ends)
    head = f"{tokens[named['bos']]} " if "bos" in named else ""
    tail = f" {tokens[named['eos']]}" if "eos" in named else ""
    return processors.TemplateProcessing(
        single=f"{head}$A{tail}",
        pair=f"{head}$A{tail} {head}$B{tail}",
        special_tokens=sorted({(tokens[i], i) for _, i in ends}),
    )
