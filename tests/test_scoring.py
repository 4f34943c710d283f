"""lm-evaluation-harness scores through the server equal its scores of transformers on the same
directory: `local-completions` reads loglikelihoods back from `echo` + `logprobs` (the OpenAI legacy
scoring form), so every prompt token's logprob must be there, in order, with the first one null.
Tasks and data are local (tests/fixtures/lm_eval): hub datasets cannot be fetched here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import torch

from tests.smol_server import smol_server

lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).parent / "fixtures" / "lm_eval"
BUDGET = 1e-3  # per-sample loglikelihood, float32 on both sides


def _tasks(tmp: Path) -> Path:
    """The two task files, pointing at the local data."""
    (tmp / "cpuserve_mc.yaml").write_text(
        f"""task: cpuserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    (tmp / "cpuserve_gen.yaml").write_text(
        f"""task: cpuserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
"""
    )
    return tmp


@pytest.fixture(scope="module")
def server(smol_dir, cache_dir, tmp_path_factory):
    with smol_server(smol_dir, cache_dir, tmp_path_factory.mktemp("server") / "server.log", max_num_seqs=16) as base:
        yield base


def _evaluate(model: str, model_args: str, task: str, include: Path, **kwargs) -> dict:  # type: ignore[no-untyped-def]
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(include)),
        log_samples=True,
        batch_size=1,
        **kwargs,
    )


def test_local_completions_scores_equal_transformers(server, smol_dir, tmp_path):
    include = _tasks(tmp_path)
    ours = _evaluate(
        "local-completions",
        f"model=smol,base_url={server}/v1/completions,tokenizer={smol_dir},tokenized_requests=True,max_retries=1",
        "cpuserve_mc",
        include,
    )
    ref = _evaluate("hf", f"pretrained={smol_dir},dtype=float32", "cpuserve_mc", include, device="cpu")
    acc = ours["results"]["cpuserve_mc"]["acc,none"]
    assert acc == ref["results"]["cpuserve_mc"]["acc,none"]
    assert acc > 0.5  # the easy questions: a model that is scored right gets most of them
    ours_samples = sorted(ours["samples"]["cpuserve_mc"], key=lambda s: s["doc_id"])
    ref_samples = sorted(ref["samples"]["cpuserve_mc"], key=lambda s: s["doc_id"])
    assert len(ours_samples) == len(ref_samples) == 16
    for a, b in zip(ours_samples, ref_samples, strict=True):
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
            assert abs(ll_a - ll_b) < BUDGET, (a["doc"], ll_a, ll_b)
            assert greedy_a == greedy_b


def test_local_chat_completions_runs_a_generation_task(server, smol_dir, tmp_path):
    include = _tasks(tmp_path)
    out = _evaluate(
        "local-chat-completions",
        f"model=smol,base_url={server}/v1/chat/completions,tokenizer={smol_dir},max_retries=1",
        "cpuserve_gen",
        include,
        apply_chat_template=True,
    )
    samples = out["samples"]["cpuserve_gen"]
    assert len(samples) == 4 and all(isinstance(s["resps"][0][0], str) and s["resps"][0][0] for s in samples)
    assert "exact_match,none" in out["results"]["cpuserve_gen"]


def test_echo_lists_every_prompt_token_then_the_generated_ones(server, hf_smol, smol_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    texts = ["The capital of France is Paris, and the capital of Italy is", "One, two, three"]
    ids = [tok(t)["input_ids"] for t in texts]
    for max_tokens in (0, 2):
        for prompt in (texts, ids):
            body = {"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": max_tokens, "temperature": 0}
            r = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
            assert [c["index"] for c in r["choices"]] == [0, 1]
            for choice, prompt_ids in zip(r["choices"], ids, strict=True):
                lp = choice["logprobs"]
                n = len(prompt_ids)
                assert len(lp["tokens"]) == n + max_tokens and lp["token_logprobs"][0] is None
                assert lp["top_logprobs"][0] is None
                assert r["usage"]["completion_tokens"] == 2 * max_tokens
                with torch.no_grad():
                    ref = torch.log_softmax(hf_smol(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
                for j in range(1, n):  # position j - 1 predicts prompt token j
                    assert abs(lp["token_logprobs"][j] - float(ref[j - 1, prompt_ids[j]])) < BUDGET
                    assert max(lp["top_logprobs"][j].values()) == pytest.approx(float(ref[j - 1].max()), abs=BUDGET)
                # Offsets are characters of the returned text: each token's text starts where it says.
                text = choice["text"]
                for token, at in zip(lp["tokens"], lp["text_offset"], strict=True):
                    assert text[at : at + len(token)] == token
                if max_tokens == 0:
                    assert choice["finish_reason"] == "length" and text == tok.decode(prompt_ids)
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": [], "text": ""}
    body = {"prompt": texts[0], "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed["text"] += choice["text"]
                streamed["tokens"] += (choice["logprobs"] or {}).get("tokens", [])
                streamed["token_logprobs"] += (choice["logprobs"] or {}).get("token_logprobs", [])
                # offsets from the start of the choice's whole text, the echoed prompt included
                streamed["text_offset"] += (choice["logprobs"] or {}).get("text_offset", [])
    whole = httpx.post(f"{server}/v1/completions", json={**body, "stream": False}, timeout=60).json()["choices"][0]
    expected = {k: whole["logprobs"][k] for k in ("tokens", "token_logprobs", "text_offset")}
    assert streamed == {**expected, "text": whole["text"]} and streamed["token_logprobs"][0] is None
