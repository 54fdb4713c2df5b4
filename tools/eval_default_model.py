#!/usr/bin/env python3
"""Evaluation of vengine's built-in default model (a small Python code model).

Two scores, both on data the model was not trained on:

* **Held-out perplexity** (per token): ``exp(mean cross-entropy)`` over the tokens
  of the held-out files, read as one stream (files joined with ``<|endoftext|>``),
  cut into non-overlapping windows of ``max_position_embeddings`` tokens; every
  token but the first of each window is predicted from the tokens before it in its
  window.

* **Parse rate** of greedy completions of held-out *function headers*.  A header is
  the source text of a ``def`` / ``async def`` signature (all its lines, decorators
  excluded) plus its docstring, taken with ``ast`` from a held-out file, dedented
  so that ``def`` is at column 0, and ending right after the docstring's closing
  quotes (no newline: with this byte-level BPE a newline and the next line's
  indentation are one token, so a prompt ending in a bare newline tells the model
  the function is over).  The model completes it greedily (``max_new_tokens`` new
  tokens, stopping early at ``<|endoftext|>``).  The completion is then cut, see
  :func:`cut_completion`:

  1. split the completion into lines at ``"\\n"``; the first piece continues the
     header's last line and is always kept;
  2. the cut is at the first later line that is not blank (``line.strip() != ""``)
     and starts at column 0 (first character neither space nor tab): that line is
     the next top-level statement, and it and everything after it are dropped;
  3. if there is no such line and the generation stopped because it hit
     ``max_new_tokens`` (not at ``<|endoftext|>``), the last line, which may be
     cut mid-token, is dropped;
  4. header plus kept text passes if a kept line after the first piece is not
     blank (a body beyond the docstring) and ``ast.parse`` accepts it.

  The parse rate is the share of headers that pass.

Run later, on any machine, against a model directory (defaults to the packaged
one), with transformers::

    python tools/eval_default_model.py [--model pyengine/default_model] [--device cuda]

By default it reads the held-out headers stored next to the model
(``heldout_headers.json``, written by ``tools/train_default_model.py``).
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)
DEFAULT_MODEL_DIR = os.path.join(REPO, "pyengine", "default_model")
HEADERS_FILE = "heldout_headers.json"

MAX_HEADER_CHARS = 1200


# --------------------------------------------------------------------------- headers
def extract_headers(source: str, max_chars: int = MAX_HEADER_CHARS) -> list[dict]:
    """Function headers (signature + docstring) of one Python source text.

    Returns dicts with ``line`` (1-based line of ``def``), ``raw`` (the header as it
    stands in the file, original indentation) and ``prompt`` (dedented, ends with
    the docstring's closing quotes).  Only functions whose docstring is followed by at least one more
    statement, whose docstring line ends right after the closing quotes, and whose
    header has no tabs are kept.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = source.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if len(body) < 2:
            continue
        doc = body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            continue
        if doc.end_lineno is None or doc.end_col_offset is None:
            continue
        first, last = node.lineno - 1, doc.end_lineno - 1
        if last >= len(lines):
            continue
        # nothing after the closing quotes on the docstring's last line
        if lines[last][doc.end_col_offset:].strip():
            continue
        # the next statement must start on a later line
        if body[1].lineno - 1 <= last:
            continue
        col = node.col_offset
        hdr = lines[first:last + 1]
        if not hdr[0][col:].lstrip().startswith(("def ", "async def ")):
            continue
        raw = "\n".join(hdr)
        if "\t" in raw or "\r" in raw or len(raw) > max_chars:
            continue
        ded = []
        ok = True
        for ln in hdr:
            if ln[:col].strip():  # a line indented less than the def (e.g. docstring text)
                ok = False
                break
            ded.append(ln[col:])
        if not ok:
            continue
        prompt = "\n".join(ded)
        try:  # the header alone (docstring as body) must parse
            ast.parse(prompt + "\n")
        except SyntaxError:
            continue
        out.append({"line": node.lineno, "raw": raw, "prompt": prompt})
    out.sort(key=lambda h: h["line"])
    return out


# --------------------------------------------------------------------------- scoring
def cut_completion(completion: str, hit_max_tokens: bool) -> str:
    """Cut a completion at the next top-level statement (see module docstring)."""
    lines = completion.split("\n")
    kept = None
    for i in range(1, len(lines)):
        ln = lines[i]
        if ln.strip() and ln[0] not in " \t":
            kept = lines[:i]
            break
    if kept is None:
        kept = lines[:-1] if hit_max_tokens else lines
    return "\n".join(kept)


def score_completion(prompt: str, completion: str, hit_max_tokens: bool) -> tuple[bool, str]:
    """(passes, program text) for one header and its raw completion."""
    body = cut_completion(completion, hit_max_tokens)
    program = prompt + body
    if not any(ln.strip() for ln in body.split("\n")[1:]):
        return False, program
    try:
        ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False, program
    return True, program


# --------------------------------------------------------------------------- transformers eval
def hf_greedy_completions(model, tok, prompts: list[str], max_new_tokens: int = 128,
                          batch_size: int = 50) -> list[tuple[list[int], bool]]:
    """Greedy completions with transformers: (new token ids up to and excl. eos, hit_max)."""
    import torch
    eos = tok.eos_token_id
    dev = next(model.parameters()).device
    results = []
    for b in range(0, len(prompts), batch_size):
        chunk = prompts[b:b + batch_size]
        enc = [tok(p, add_special_tokens=False)["input_ids"] for p in chunk]
        width = max(len(e) for e in enc)
        ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for i, e in enumerate(enc):  # left padding
            ids[i, width - len(e):] = torch.tensor(e)
            mask[i, width - len(e):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                 do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=tok.pad_token_id)
        for row in out[:, width:].tolist():
            new = []
            for t in row:
                if t == eos:
                    break
                new.append(t)
            results.append((new, len(new) >= max_new_tokens))
    return results


def parse_rate_hf(model, tok, headers: list[dict], max_new_tokens: int = 128,
                  verbose: int = 0) -> tuple[float, list[dict]]:
    prompts = [h["prompt"] for h in headers]
    comps = hf_greedy_completions(model, tok, prompts, max_new_tokens)
    rows = []
    for h, (ids, hit) in zip(headers, comps):
        text = tok.decode(ids)
        ok, program = score_completion(h["prompt"], text, hit)
        rows.append({"path": h.get("path"), "line": h.get("line"), "ok": ok,
                     "completion": text, "program": program})
    rate = sum(r["ok"] for r in rows) / max(1, len(rows))
    for r in rows[:verbose]:
        print(f"---- {r['path']}:{r['line']} parse={'ok' if r['ok'] else 'FAIL'}\n{r['program']}\n")
    return rate, rows


def perplexity_hf(model, token_ids, window: int, batch_size: int = 32,
                  max_tokens: int | None = None) -> tuple[float, int]:
    """Per-token perplexity over a 1-D token stream in non-overlapping windows."""
    import torch
    import torch.nn.functional as F
    dev = next(model.parameters()).device
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = (ids.numel() // window) * window
    if n == 0:
        n = ids.numel()
        window = n
    wins = ids[:n].view(-1, window)
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for b in range(0, wins.shape[0], batch_size):
            x = wins[b:b + batch_size].to(dev)
            logits = model(input_ids=x, use_cache=False).logits.float()
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   x[:, 1:].reshape(-1), reduction="sum")
            tot += loss.item()
            cnt += x[:, 1:].numel()
    return math.exp(tot / cnt), cnt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--headers", default=None, help=f"json list of headers (default: <model>/{HEADERS_FILE})")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--show", type=int, default=3, help="print this many completions")
    ap.add_argument("--ppl", action="store_true",
                    help="also held-out perplexity on this machine's held-out-bucket files "
                         "(stdlib + site-packages whose path hash puts them in the held-out split)")
    ap.add_argument("--ppl-max-tokens", type=int, default=2_000_000)
    ap.add_argument("--json", default=None, help="write per-header results here")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(dev).eval()
    with open(args.headers or os.path.join(args.model, HEADERS_FILE)) as f:
        headers = json.load(f)["headers"][: args.limit]
    if args.ppl:
        import numpy as np
        import train_default_model as tr
        t0 = time.time()
        files = [(r, t) for r, t in tr.gather_files(0, 1e12, True) if tr.is_heldout(r, 2.0)]
        ids = []
        for e in tok.backend_tokenizer.encode_batch([t for _, t in files], add_special_tokens=False):
            ids.extend(e.ids)
            ids.append(tok.eos_token_id)
        ppl, n = perplexity_hf(model, np.asarray(ids), model.config.max_position_embeddings,
                               batch_size=8, max_tokens=args.ppl_max_tokens)
        print(f"held-out perplexity: {ppl:.3f} per token over {n} tokens of {len(files)} held-out files "
              f"({time.time() - t0:.1f} s)")
    t0 = time.time()
    rate, rows = parse_rate_hf(model, tok, headers, args.max_new_tokens, verbose=args.show)
    print(f"parse rate: {sum(r['ok'] for r in rows)}/{len(rows)} = {rate:.1%}  ({time.time() - t0:.1f} s, {dev}, {args.dtype})")
    print("per header: " + "".join("1" if r["ok"] else "0" for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"parse_rate": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
