"""Device debug of the draft chain (not a test): a tiny target/draft pair on CUDA under a
few variants, each in its own process: `python3 tools/debug/chain_debug.py VARIANT`."""
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, ".")
import torch
from transformers import AutoTokenizer

from pyengine import LLM, SamplingParams
from tests.helpers import build_tiny_model, build_tokenizer, prompt_token_ids

variant = sys.argv[1]
d = Path(tempfile.mkdtemp())
tk = build_tokenizer(d / "tok")
tok = AutoTokenizer.from_pretrained(str(tk))
ll = build_tiny_model(d / "llama", "llama", tk, seed=1)
dr = build_tiny_model(d / "dr", "qwen3", tk, seed=7, num_hidden_layers=2)
base = prompt_token_ids(tok, 3, min_len=4, max_len=20, seed=4)
prompts = [base[0] * 3, base[1], base[2] + base[2]]
sp = SamplingParams(temperature=0, max_tokens=24)
if "nocapture" in variant:
    from pyengine.spec_decode.draft_model import DraftModelProposer
    DraftModelProposer.enable_draft_chain = lambda self, mode=None: 0.0
if "shared" in variant:
    from pyengine.spec_decode import draft_chain
    init = draft_chain.DraftChain.__init__
    def shared_init(self, *a, **kw):
        init(self, *a, **kw)
        self.own_stream = False
    draft_chain.DraftChain.__init__ = shared_init
if "off" in variant:
    off = LLM(str(ll), device="cuda", dtype="float32")
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    off.shutdown()
    if "gc" in variant:
        import gc
        del off
        gc.collect()
        torch.cuda.empty_cache()
spec = {"method": "draft_model", "model": str(dr), "num_speculative_tokens": 3}
llm = LLM(str(ll), device="cuda", dtype="float32", speculative_config=spec, async_scheduling="async" in variant)
drafter = llm.llm_engine.engine_core.model_runner.drafter
chain = drafter._chain
if chain is None:
    chain = type("NoChain", (), {"run": None})()
if "nochain" in variant:
    drafter._chain = None
run = chain.run
if "blockcopy" in variant or "syncbefore" in variant:
    def run(plan):
        n = len(plan.seqs)
        bs = chain._size(n)
        if "syncbefore" in variant:
            torch.cuda.synchronize()
        chain._fill(plan, bs)
        chain._d64.copy_(chain._h64, non_blocking="blockcopy" not in variant)
        chain._d32.copy_(chain._h32, non_blocking="blockcopy" not in variant)
        chain.graphs[bs].replay()
        return chain.outputs[bs][:n]
    chain.run = run
if "syncafter" in variant or "clone" in variant:
    def wrapped(plan):
        out = run(plan)
        if "clone" in variant:
            out = out.clone()
        if "syncafter" in variant:
            torch.cuda.synchronize()
        return out
    chain.run = wrapped
try:
    outs = llm.generate(prompts, sp, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    print(variant, "OK", got == ref if "off" in variant else "", flush=True)
except Exception as e:
    print(variant, "FAILED", type(e).__name__, str(e)[:200], flush=True)
    traceback.print_exc(limit=40)
