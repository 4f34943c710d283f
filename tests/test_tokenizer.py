"""The tokenizer rebuilt from the GGUF against transformers' tokenizer loaded from the same GGUF."""

from __future__ import annotations

import pytest

from cpuserve.detokenizer import IncrementalDetokenizer
from cpuserve.model.resolve import bundled_gguf
from cpuserve.tokenizer import Tokenizer

SAMPLES = [
    "Hello world! Grüße aus Köln, 東京は晴れです。 Привет, мир. مرحبا بالعالم. नमस्ते दुनिया",
    "Emoji: 🤖🚀👩‍💻🇫🇷 and accents café naïve déjà vu; ZWJ 👨‍👩‍👧‍👦",
    "def f(x: int) -> int:\n\treturn x**2 + 123 // 4567  # 3.14159\n\n\n    if x != 0:\n        print(f'{x!r}')",
    "   leading and  multiple   spaces\r\n and tabs\t\tend  ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "numbers 1234567890 0.5 -42 1e-9 and 2024-11-29",
]


@pytest.fixture(scope="module")
def ref():
    transformers = pytest.importorskip("transformers")
    path = bundled_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def ours(smol_dir):
    return Tokenizer(smol_dir)


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_equals_transformers_from_gguf(text, ref, ours):
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert ours.encode(text) == ref.encode(text)


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_equals_transformers_from_gguf(text, ref, ours):
    ids = ref.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round-trips exactly


def test_special_tokens_stay_whole(ours):
    assert ours.encode("<|im_start|>", add_special_tokens=False) == [ours.token_to_id("<|im_start|>")] == [1]
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_detokenizer_streams_the_full_text(text, ours):
    prompt = ours.encode("Prefix:", add_special_tokens=False)
    ids = ours.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, prompt, skip_special_tokens=False)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == ours.decode(ids, skip_special_tokens=False)
    assert all("\ufffd" not in p for p in pieces)
    # Multi-byte characters split across tokens produce empty pieces until they are complete.
    if any(ord(c) > 0xFFFF for c in text):
        assert "" in pieces


def test_chat_template_faults_name_the_message_and_the_line(ours):
    from cpuserve.tokenizer import ChatTemplateError

    template = "{% for m in messages %}\n{{ m['content'] | length + m['extra'] }}\n{% endfor %}"
    messages = [{"role": "user", "content": "a", "extra": 1}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match=r"on message 1 at template line 2"):
        ours.apply_chat_template(messages, template=template)


def test_chat_templates_render_as_transformers_renders_them(ours):
    # Plain-JSON tojson (Jinja's own escapes < > & '), loop controls and the generation tag.
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
    )
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "it's <b> & é"}]
    assert ours.apply_chat_template(messages, template=template) == '{"role": "user", "content": "it\'s <b> & é"}'
    # A null content (an assistant tool-call turn) reaches a template that can take it as None.
    tool_turn = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]
    rendered = ours.apply_chat_template(tool_turn, template="{{ messages[0].content is none }}")
    assert rendered == "True"


def test_content_parts_reach_templates_that_loop_over_them(ours):
    looping = "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}"
    assert ours.takes_content_parts(looping)
    assert ours.takes_content_parts("{% for m in messages %}{% for p in m.content | list %}{% endfor %}{% endfor %}")
    assert not ours.takes_content_parts("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not ours.takes_content_parts()  # SmolLM2's own template prints the content
