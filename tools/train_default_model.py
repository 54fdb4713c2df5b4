#!/usr/bin/env python3
"""Train vengine's built-in default model: a small Qwen3 code model on Python source.

Data (``gather_files``): every ``*.py`` file of the running Python's standard library
(``sysconfig.get_paths()["stdlib"]``) and of its ``site-packages``
(``sysconfig.get_paths()["purelib"]``, skipped with ``--no-site-packages``), excluding
directories named ``test``, ``tests``, ``__pycache__``, ``site-packages`` inside the
stdlib, ``idlelib``/``turtledemo``, files over 256 KB, files that are not UTF-8, look
generated (more than 5% of the characters in lines longer than 200 characters), or are
exact duplicates of a file already taken (by content hash).  When the files exceed
``--max-mb``, a subset is taken in a seeded pseudo-random order of their paths.

Split: **by file**.  A file is held out when ``int(sha1(relpath)[:8], 16) % 1000 <
10 * --heldout-pct`` (2% by default), where relpath is ``stdlib/<path>`` or
``site/<path>``; the split does not depend on the seed.  The held-out files give the
held-out loss / perplexity and the 100 evaluation function headers (see
``tools/eval_default_model.py``), skipping any header whose exact text also occurs in
the training text.

Tokenizer: byte-level BPE trained with ``tokenizers`` on (at most
``--tok-sample-mb`` of) the training files, ``--vocab`` entries, one special token
``<|endoftext|>`` (id 0) used as bos, eos and pad; no bos is added to prompts.

Model: ``transformers.Qwen3ForCausalLM`` from a config (tied embeddings, GQA),
trained with AdamW in bf16 autocast on random windows of the concatenated training
stream (files joined by ``<|endoftext|>``).  By default the loop is time-budgeted
(``--minutes``) and the learning-rate schedule follows elapsed time; pass
``--steps N`` for a fixed-step, schedule-by-step run (the data order, initialisation,
split and tokenizer are all fixed by ``--seed``; only GPU reduction order may differ).
``--compile`` compiles each decoder layer with ``torch.compile`` (regional compilation:
the layers share one compiled graph), for more tokens per second in a time budget; if
the first step fails to compile, the run restarts eagerly from the same initialisation
(the run without ``--compile``, step for step).

Output: an HF directory: config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json, generation_config.json, heldout_headers.json and README.md.

    PYTHONUNBUFFERED=1 python3 tools/train_default_model.py --out OUT/model
    python tools/train_default_model.py --out /tmp/tiny --tiny --minutes 0.5   # CPU smoke test
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import eval_default_model as ev  # noqa: E402

EOT = "<|endoftext|>"
SKIP_DIRS = {"test", "tests", "__pycache__", "site-packages", "idlelib", "turtledemo",
             "dist-packages"}
T_START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T_START:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- data
def looks_generated(text: str) -> bool:
    long_chars = sum(len(ln) for ln in text.split("\n") if len(ln) > 200)
    return long_chars > 0.05 * max(1, len(text))


def walk_py(root: str, prefix: str) -> list[tuple[str, str]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                full = os.path.join(dirpath, fn)
                out.append((prefix + "/" + os.path.relpath(full, root).replace(os.sep, "/"), full))
    return out


def is_heldout(relpath: str, pct: float) -> bool:
    return int(hashlib.sha1(relpath.encode()).hexdigest()[:8], 16) % 1000 < int(round(10 * pct))


def gather_files(seed: int, max_mb: float, site_packages: bool) -> list[tuple[str, str]]:
    """[(relpath, text)] in a seeded order; deterministic for a given machine."""
    paths = sysconfig.get_paths()
    cands = walk_py(paths["stdlib"], "stdlib")
    if site_packages and os.path.isdir(paths["purelib"]):
        cands += walk_py(paths["purelib"], "site")
    # stdlib first, then site-packages, each in a seeded order of relpaths
    def key(rp):
        return (0 if rp.startswith("stdlib/") else 1,
                hashlib.sha1(f"{seed}:{rp}".encode()).hexdigest())
    cands.sort(key=lambda c: key(c[0]))
    seen, out, total = set(), [], 0
    budget = int(max_mb * 1e6)
    for rel, full in cands:
        try:
            if os.path.getsize(full) > 256_000:
                continue
            with open(full, "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = text.replace("\r\n", "\n")
        if len(text.strip()) < 64 or "\x00" in text or looks_generated(text):
            continue
        h = hashlib.sha1(text.encode()).digest()
        if h in seen:
            continue
        seen.add(h)
        out.append((rel, text))
        total += len(text)
        if total >= budget:
            break
    return out


# --------------------------------------------------------------------------- tokenizer
# A code model has no roles: the messages' contents joined by newlines, nothing after the
# last one (a trailing bare newline would read as "the block is over", see the card).
CHAT_TEMPLATE = ("{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
                 "{{ message['content'] }}{% endfor %}")


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def write_tokenizer(tok, out: str, max_len: int) -> None:
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT, "eos_token": EOT, "pad_token": EOT, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


# --------------------------------------------------------------------------- model
def make_config(args, vocab: int):
    from transformers import Qwen3Config
    return Qwen3Config(
        vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.seq_len, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attention_bias=False, use_sliding_window=False, initializer_range=0.02,
        hidden_act="silu", dtype="bfloat16",
    )


def lr_at(args, step: int, progress: float) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(1.0, max(0.0, progress))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def main() -> None:
    ap = argparse.ArgumentParser(description="train vengine's default code model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--minutes", type=float, default=6.5, help="training-loop wall-clock budget")
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (overrides --minutes)")
    ap.add_argument("--deadline-minutes", type=float, default=9.0,
                    help="whole-script wall clock: the loop stops early to leave ~75 s for saving and eval")
    ap.add_argument("--max-mb", type=float, default=200.0, help="cap on source text (MB)")
    ap.add_argument("--no-site-packages", dest="site_packages", action="store_false")
    ap.add_argument("--heldout-pct", type=float, default=2.0)
    ap.add_argument("--tok-sample-mb", type=float, default=40.0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokenizer", default=None,
                    help="a model directory whose tokenizer.json to use instead of training one "
                         "(e.g. pyengine/default_model: a larger model sharing the built-in model's vocabulary)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=640)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--n-headers", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny data and model")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    args = ap.parse_args()
    if args.tiny:
        args.max_mb = min(args.max_mb, 3.0)
        args.tok_sample_mb = min(args.tok_sample_mb, 2.0)
        args.site_packages = False
        args.vocab, args.hidden, args.intermediate, args.layers = 1024, 64, 128, 2
        args.heads, args.kv_heads, args.head_dim = 2, 1, 32
        args.seq_len, args.batch, args.warmup = 256, 8, 10
        args.log_every, args.eval_every = 10, 40
        args.n_headers, args.max_new_tokens = 10, 32
        args.heldout_pct = 10.0
    cmdline = "python3 tools/train_default_model.py " + " ".join(sys.argv[1:])

    import numpy as np
    import torch
    import torch.nn.functional as F

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    hw = torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine()
    log(f"python {platform.python_version()} torch {torch.__version__} device {dev} ({hw})")
    os.makedirs(args.out, exist_ok=True)

    # ---- data
    files = gather_files(args.seed, args.max_mb, args.site_packages)
    train_files = [(r, t) for r, t in files if not is_heldout(r, args.heldout_pct)]
    held_files = [(r, t) for r, t in files if is_heldout(r, args.heldout_pct)]
    n_std = sum(r.startswith("stdlib/") for r, _ in files)
    train_chars = sum(len(t) for _, t in train_files)
    held_chars = sum(len(t) for _, t in held_files)
    log(f"data: {len(files)} files ({n_std} stdlib, {len(files) - n_std} site-packages); "
        f"train {len(train_files)} files {train_chars / 1e6:.1f} MB, held-out {len(held_files)} files {held_chars / 1e6:.2f} MB")

    # ---- tokenizer
    sample, acc = [], 0
    for _, t in train_files:
        if acc >= args.tok_sample_mb * 1e6:
            break
        sample.append(t)
        acc += len(t)
    if args.tokenizer:  # reuse a model's tokenizer (a draft/target pair must share one)
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
        log(f"tokenizer: {args.tokenizer}/tokenizer.json")
    else:
        tok = train_tokenizer(sample, args.vocab)
    vocab = tok.get_vocab_size()
    eot_id = tok.token_to_id(EOT)
    assert eot_id == 0, eot_id
    if not args.tokenizer:
        log(f"tokenizer: byte-level BPE, vocab {vocab}, trained on {acc / 1e6:.1f} MB")

    def encode_stream(fs):
        encs = tok.encode_batch([t for _, t in fs], add_special_tokens=False)
        lens = [len(e.ids) + 1 for e in encs]
        arr = np.empty(sum(lens), dtype=np.int32)
        pos = 0
        for e, n in zip(encs, lens):
            arr[pos:pos + n - 1] = e.ids
            arr[pos + n - 1] = eot_id
            pos += n
        return arr

    train_ids = encode_stream(train_files)
    held_ids = encode_stream(held_files)
    log(f"tokens: train {len(train_ids) / 1e6:.2f} M ({train_chars / len(train_ids):.2f} chars/token), held-out {len(held_ids) / 1e6:.3f} M")

    # ---- eval headers from held-out files (not also present verbatim in the training text)
    train_text = "\n".join(t for _, t in train_files)
    cands = []
    for rel, text in held_files:
        for h in ev.extract_headers(text):
            h["path"] = rel
            cands.append(h)
    rng = random.Random(args.seed)
    rng.shuffle(cands)
    headers, leaked = [], 0
    for h in cands:
        if len(headers) >= args.n_headers:
            break
        if h["raw"].strip() in train_text:
            leaked += 1
            continue
        headers.append({"path": h["path"], "line": h["line"], "prompt": h["prompt"]})
    del train_text
    log(f"eval headers: {len(headers)} of {len(cands)} candidates ({leaked} skipped as present in training text)")

    # ---- model
    from transformers import Qwen3ForCausalLM
    config = make_config(args, vocab)

    init_rng = torch.get_rng_state()  # (the weights are initialised on the host)

    def build(compiled: bool, reseed: bool = False):
        if reseed:  # the eager restart starts from the same initialisation: the run without --compile
            torch.set_rng_state(init_rng)
        m = Qwen3ForCausalLM(config).to(dev)
        m.config._attn_implementation = "sdpa"
        m.train()
        if compiled:
            for layer in m.model.layers:
                layer.compile()
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in m.named_parameters() if p.dim() < 2]
        o = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)
        return m, o

    model, opt = build(args.compile)
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.get_input_embeddings().weight.numel()
    log(f"model: Qwen3 hidden {args.hidden} layers {args.layers} heads {args.heads}/{args.kv_heads}x{args.head_dim} "
        f"ffn {args.intermediate} ctx {args.seq_len}: {n_params / 1e6:.2f} M params ({n_emb / 1e6:.2f} M embedding, tied)")


    T, B = args.seq_len, args.batch
    train_t = torch.from_numpy(train_ids.astype(np.int64)).to(dev)
    held_t = torch.from_numpy(held_ids.astype(np.int64))
    gen = torch.Generator().manual_seed(args.seed)
    # 32 windows spread evenly over the held-out stream (for the loss curve; the final
    # perplexity uses all held-out tokens)
    n_windows_eval = min(32, max(1, len(held_ids) // T))
    starts = torch.linspace(0, len(held_ids) - T, n_windows_eval).long()
    eval_x = torch.stack([held_t[s:s + T] for s in starts.tolist()]).to(dev)
    ar = torch.arange(T + 1, device=dev)
    amp = torch.autocast(device_type=dev.type, dtype=torch.bfloat16)

    def batch():
        off = torch.randint(0, len(train_ids) - T - 1, (B,), generator=gen).to(dev)
        w = train_t[off[:, None] + ar]
        return w[:, :-1], w[:, 1:]

    def held_loss():
        model.eval()
        with torch.no_grad(), amp:
            lg = model(input_ids=eval_x, use_cache=False).logits.float()
            loss = F.cross_entropy(lg[:, :-1].reshape(-1, vocab), eval_x[:, 1:].reshape(-1))
        model.train()
        return loss.item()

    budget = min(args.minutes * 60.0, args.deadline_minutes * 60.0 - 75.0 - (time.time() - T_START))
    log(f"training: batch {B}x{T} = {B * T} tokens/step, lr {args.lr} warmup {args.warmup} cosine to {args.min_lr_frac}x, "
        + (f"{args.steps} steps" if args.steps else f"budget {budget:.0f} s"))
    print(f"{'step':>6} {'tokens':>10} {'train_loss':>10} {'heldout':>8} {'lr':>9} {'tok/s':>9} {'elapsed':>8}", flush=True)
    t0 = time.time()
    step, acc_loss, acc_n, last_held = 0, torch.zeros((), device=dev), 0, float("nan")
    last_train = float("nan")
    t_last, tok_last = t0, 0
    while True:
        elapsed = time.time() - t0
        if args.steps:
            if step >= args.steps:
                break
            progress = step / args.steps
        else:
            if elapsed >= budget:
                break
            progress = elapsed / budget
        lr = lr_at(args, step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch()

        def forward_backward():
            with amp:
                logits = model(input_ids=x, use_cache=False).logits
            out = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1))
            out.backward()
            return out

        if step == 0 and args.compile:
            try:
                loss = forward_backward()
                log(f"compiled the decoder layers in {time.time() - t0:.1f} s (first step)")
            except Exception as e:  # noqa: BLE001 - any compile failure: train eagerly instead
                log(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); training eagerly")
                model, opt = build(False, reseed=True)
                for g in opt.param_groups:  # (the new optimizer's groups: this step's lr, not --lr)
                    g["lr"] = lr
                loss = forward_backward()
        else:
            loss = forward_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        acc_loss += loss.detach()
        acc_n += 1
        step += 1
        if step % args.eval_every == 0 or step == 1:
            last_held = held_loss()
        if step % args.log_every == 0 or step == 1:
            now = time.time()
            tl = last_train = (acc_loss / acc_n).item()
            tps = (step * B * T - tok_last) / max(1e-9, now - t_last)
            print(f"{step:6d} {step * B * T:10d} {tl:10.4f} {last_held:8.4f} {lr:9.2e} {tps:9.0f} {now - t0:7.1f}s", flush=True)
            acc_loss.zero_()
            acc_n, t_last, tok_last = 0, now, step * B * T
    train_secs = time.time() - t0
    final_train = (acc_loss / acc_n).item() if acc_n else last_train
    final_held = held_loss()
    log(f"trained {step} steps, {step * B * T / 1e6:.1f} M tokens in {train_secs:.1f} s; "
        f"last train loss {final_train:.4f}, held-out loss (eval windows) {final_held:.4f}")

    # ---- save (bf16), then reload from disk and evaluate what is shipped
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config.do_sample = False
    model.generation_config.bos_token_id = 0
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 0
    model.generation_config.max_new_tokens = 128
    model.save_pretrained(args.out, safe_serialization=True)
    write_tokenizer(tok, args.out, args.seq_len)
    with open(os.path.join(args.out, ev.HEADERS_FILE), "w") as f:
        json.dump({"about": "function headers (signature + docstring) from held-out files, "
                   "for tools/eval_default_model.py and tests/test_default_model.py",
                   "headers": headers}, f, indent=1)
    del model, opt, train_t
    if cuda:
        torch.cuda.empty_cache()
    log(f"saved to {args.out}: " + ", ".join(f"{n} ({os.path.getsize(os.path.join(args.out, n)) / 1e6:.2f} MB)"
                                             for n in sorted(os.listdir(args.out))))

    from transformers import AutoModelForCausalLM, AutoTokenizer
    htok = AutoTokenizer.from_pretrained(args.out)
    hmodel = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16).to(dev).eval()
    assert htok("def f(x):\n    return x\n")["input_ids"] == tok.encode("def f(x):\n    return x\n").ids
    t1 = time.time()
    ppl, n_ppl = ev.perplexity_hf(hmodel, held_ids, T, max_tokens=2_000_000)
    log(f"held-out perplexity: {ppl:.3f} per token over {n_ppl} tokens (loss {math.log(ppl):.4f}; {time.time() - t1:.1f} s)")
    t1 = time.time()
    rate, rows = ev.parse_rate_hf(hmodel, htok, headers, args.max_new_tokens, verbose=3)
    n_ok = sum(r["ok"] for r in rows)
    log(f"parse rate: {n_ok}/{len(rows)} = {rate:.1%} ({time.time() - t1:.1f} s)")
    print("per-header parse results (first 20 of test sample order): "
          + " ".join("1" if r["ok"] else "0" for r in rows[:20]), flush=True)

    # ---- model card
    size_mb = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out)) / 1e6
    example = next((r for r in rows if r["ok"]), rows[0] if rows else None)
    card = f"""---
license: other
library_name: transformers
pipeline_tag: text-generation
tags: [code, python, qwen3, vengine]
---
# vengine default model: a {n_params / 1e6:.1f}M-parameter Python code model

vengine's built-in default model (`LLM()` and `vengine serve` with no model load it). A
Qwen3-architecture causal LM trained from scratch on Python source, with its own byte-level
BPE tokenizer. It completes Python code; it does not follow instructions.

| | |
| --- | --- |
| architecture | `Qwen3ForCausalLM`: hidden {args.hidden}, {args.layers} layers, {args.heads} query / {args.kv_heads} KV heads of dim {args.head_dim}, SwiGLU {args.intermediate}, RoPE theta 10000, RMSNorm, tied embeddings, context {args.seq_len} |
| parameters | {n_params:,} ({n_emb:,} in the tied embedding) |
| weights | `model.safetensors`, bf16; directory {size_mb:.1f} MB |
| tokenizer | byte-level BPE (`tokenizers`), vocab {vocab}; `<|endoftext|>` (id 0) is bos, eos and pad; no bos is added |
| data | `*.py` of the Python {platform.python_version()} standard library{' and site-packages' if args.site_packages else ''} on the training machine (test dirs excluded, deduplicated), {len(files)} files; split by file (sha1 of the path, {args.heldout_pct:g}% held out): train {train_chars / 1e6:.1f} MB = {len(train_ids) / 1e6:.1f} M tokens, held-out {held_chars / 1e6:.2f} MB = {len(held_ids) / 1e6:.2f} M tokens |
| training | {step} steps of {B}x{T} tokens ({step * B * T / 1e6:.0f} M tokens), AdamW lr {args.lr} cosine, bf16 autocast, {train_secs:.0f} s on one {hw}; seed {args.seed} |
| final train loss | {final_train:.3f} |
| held-out perplexity | **{ppl:.2f}** per token (loss {math.log(ppl):.3f}, {n_ppl:,} tokens) |
| held-out parse rate | **{n_ok}/{len(rows)} = {rate:.0%}** of greedy completions ({args.max_new_tokens} new tokens) of held-out function headers parse |
| date | 2026-11-29 |

Training command (the loop is time-budgeted; `--steps {step}` repeats this run step for step):

```
{cmdline}
```

Evaluation (`tools/eval_default_model.py`, headers in `heldout_headers.json`): a header is
a held-out function's signature plus docstring, dedented, ending right after the closing
quotes; the greedy completion is cut at the first later non-blank line at column 0 (the
next top-level statement), or, when it ran out of tokens without one, its last (partial)
line is dropped; the header plus what is kept must contain a body line and pass
`ast.parse`.

Prompting: end a prompt where code continues (after `:` or a docstring's closing quotes),
not with a bare newline. The tokenizer merges a newline with the next line's indentation,
so a prompt ending in `"\\n"` reads as "the block is over".

Example (held-out `{example['path'] if example else ''}`), prompt plus greedy completion as cut:

```python
{example['program'] if example else ''}
```
"""
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(card)
    log(f"done: {n_params / 1e6:.2f} M params, train {train_secs:.0f} s, held-out ppl {ppl:.2f}, parse {rate:.0%}, dir {size_mb:.1f} MB")


if __name__ == "__main__":
    main()
