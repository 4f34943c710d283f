"""The reference decoder on the real SmolLM2 weights against transformers on the same directory."""

from __future__ import annotations

import pytest
import torch

from cpuserve.generate import SimpleSampling, generate_ids
from cpuserve.tokenizer import Tokenizer

# fp32 on both sides; the implementations differ in attention kernels and op order only.
LOGIT_ABS_BUDGET = 2e-4  # measured: about 3e-5

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 1, 2, 3, 5, 8, 13,",
    "Les ordinateurs quantiques sont",
]


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return Tokenizer(smol_dir)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_position_logits_match_transformers(prompt, tokenizer, hf_smol, our_smol):
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        ref = hf_smol(ids).logits[0, -1]
    ours = our_smol(ids)[0, -1]
    assert ours.shape == ref.shape == (49152,)
    err = (ours - ref).abs().max().item()
    assert err < LOGIT_ABS_BUDGET, f"max |logit diff| {err:.2e} over budget {LOGIT_ABS_BUDGET:.0e}"
    assert int(ours.argmax()) == int(ref.argmax())


def _hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache, ignoring EOS (n tokens exactly)."""
    out: list[int] = []
    with torch.inference_mode():
        result = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(n):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True)
    return out


@pytest.mark.parametrize(
    "kind,text",
    [
        ("plain", "The three most important inventions of the 20th century are"),
        ("plain", "import numpy as np\n\n# compute the mean of a list\ndef mean(xs):"),
        ("chat", "Write a haiku about the sea."),
    ],
)
def test_32_greedy_tokens_equal_transformers(kind, text, tokenizer, hf_smol, our_smol):
    if kind == "chat":
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": text}])
    else:
        prompt_ids = tokenizer.encode(text)
    ours = list(generate_ids(our_smol, prompt_ids, SimpleSampling(max_tokens=32)))
    ref = _hf_greedy(hf_smol, prompt_ids, 32)
    assert ours == ref, f"ours: {tokenizer.decode(ours)!r}\nref:  {tokenizer.decode(ref)!r}"


def test_chat_template_matches_transformers(smol_dir, tokenizer):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(smol_dir)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    for msgs in (messages, messages[1:2]):
        expected = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert tokenizer.apply_chat_template(msgs) == expected
        ids = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert tokenizer.encode_chat(msgs) == list(ids)


def test_bf16_greedy_answer_is_sensible(smol_dir, tokenizer):
    """The checkpoint's own dtype (bf16) answers the README's question correctly."""
    from cpuserve.model.loader import load_model

    model = load_model(smol_dir, "bfloat16")
    assert model.dtype == torch.bfloat16
    ids = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = list(generate_ids(model, ids, SimpleSampling(max_tokens=16, stop_token_ids=(2,))))
    assert "Paris" in tokenizer.decode(out)


def test_seeded_sampling_is_reproducible(tokenizer, our_smol):
    ids = tokenizer.encode("Tell me a story about")
    params = SimpleSampling(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    first = list(generate_ids(our_smol, ids, params))
    again = list(generate_ids(our_smol, ids, params))
    other = list(generate_ids(our_smol, ids, SimpleSampling(max_tokens=12, temperature=0.9, top_p=0.95, seed=99)))
    assert first == again
    assert first != other
