"""The built-in default model (pyengine/default_model, made by tools/train_default_model.py).

CPU only.  Checks that transformers loads the directory, that vengine's greedy output
equals transformers' token for token, and that at least half of a fixed sample of
held-out function headers parse after a greedy completion through vengine, so a broken
attention / RoPE / KV-cache / sampling path fails here (garbage does not parse).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import eval_default_model as ev  # noqa: E402

MODEL_DIR = os.path.join(REPO, "pyengine", "default_model")
SAMPLE = 10          # first SAMPLE headers of heldout_headers.json (a seeded shuffle)
MAX_NEW = 128
MATCH_NEW = 48
# prompts end where code continues: the tokenizer merges a newline with the next line's
# indentation, so a bare trailing newline reads as "block over"
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "import os\nimport sys\n\n\ndef main(argv):",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def read_config(path):\n    with open(path) as f:",
]


@pytest.fixture(scope="module")
def headers():
    with open(os.path.join(MODEL_DIR, ev.HEADERS_FILE)) as f:
        return json.load(f)["headers"][:SAMPLE]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="module")
def llm():
    from pyengine import LLM

    # no model: resolves to the built-in default model (pyengine/default_model)
    return LLM(device="cpu", dtype="float32")


def _vengine_greedy(llm, prompts, max_tokens):
    from pyengine import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _strip_eos(ids, eos):
    ids = list(ids)
    return ids[: ids.index(eos)] if eos in ids else ids


def test_directory_is_complete_and_small():
    names = set(os.listdir(MODEL_DIR))
    for n in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "README.md", ev.HEADERS_FILE):
        assert n in names, n
    total = sum(os.path.getsize(os.path.join(MODEL_DIR, n)) for n in names)
    assert total <= 20_000_000, total
    from safetensors import safe_open
    with safe_open(os.path.join(MODEL_DIR, "model.safetensors"), "pt") as f:
        for k in f.keys():
            assert f.get_slice(k).get_dtype() == "BF16", k


def test_transformers_loads(hf):
    model, tok = hf
    cfg = model.config
    assert cfg.model_type in ("qwen3", "llama")
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n <= 10_500_000, n
    assert tok.eos_token_id == cfg.eos_token_id == 0
    assert tok.pad_token_id == 0 and tok.bos_token_id == 0
    src = "def f(x):\n    return {'a': x ** 2}  # ünïcode\n"
    ids = tok(src, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == src
    code = "    def __init__(self, name, value=None):\n        self.name = name\n        self.value = value\n"
    assert len(tok(code, add_special_tokens=False)["input_ids"]) < len(code) / 3  # BPE merges code


def test_transformers_sample_parses(hf, headers):
    model, tok = hf
    rate, rows = ev.parse_rate_hf(model, tok, headers, MAX_NEW)
    assert sum(r["ok"] for r in rows) * 2 >= len(rows), [r["program"] for r in rows]


def test_vengine_greedy_matches_transformers(hf, llm):
    model, tok = hf
    outs = _vengine_greedy(llm, PROMPTS, MATCH_NEW)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MATCH_NEW, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        got = _strip_eos(out.token_ids, tok.eos_token_id)
        want = _strip_eos(ref, tok.eos_token_id)
        assert got == want, (prompt, tok.decode(got), tok.decode(want))
        assert len(want) >= 16, (prompt, tok.decode(want))  # a real continuation, not an early eos


def test_vengine_sample_parses(llm, headers, hf):
    _, tok = hf
    outs = _vengine_greedy(llm, [h["prompt"] for h in headers], MAX_NEW)
    ok, programs = 0, []
    for h, out in zip(headers, outs):
        ids = _strip_eos(out.token_ids, tok.eos_token_id)
        passed, program = ev.score_completion(h["prompt"], tok.decode(ids), len(ids) >= MAX_NEW)
        ok += passed
        programs.append(program)
    assert ok * 2 >= len(headers), programs
