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
if "fill" in variant:  # torch.empty filled with NaN / the dtype's max: uninitialized reads show
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
if "check" in variant:  # stop at the first forward fed an id outside the vocabulary
    from pyengine.worker.model_runner import ModelRunner as _R
    _fwd = _R.forward
    def checked(self, ids, pos, meta):
        v = self.model.model.embed_tokens.num_embeddings
        bad = ((ids < 0) | (ids >= v)).nonzero().flatten().tolist()
        if bad:
            print(variant, "BAD ids at", bad[:20], "ids", ids.tolist()[:64], "pos", pos.tolist()[:64],
                  "qsl", meta.query_start_loc.tolist(), "seq", meta.seq_lens.tolist(), flush=True)
            raise RuntimeError("bad ids")
        return _fwd(self, ids, pos, meta)
    _R.forward = checked
d = Path(tempfile.mkdtemp())
tk = build_tokenizer(d / "tok")
tok = AutoTokenizer.from_pretrained(str(tk))
ll = build_tiny_model(d / "llama", "llama", tk, seed=1)
dr = build_tiny_model(d / "dr", "qwen3", tk, seed=7, num_hidden_layers=2)
base = prompt_token_ids(tok, 3, min_len=4, max_len=20, seed=4)
prompts = [base[0] * 3, base[1], base[2] + base[2]]
sp = SamplingParams(temperature=0, max_tokens=24)
dtype = "bfloat16" if "bf16" in variant else "float32"
if "nocapture" in variant:
    from pyengine.spec_decode.draft_model import DraftModelProposer
    DraftModelProposer.enable_draft_chain = lambda self, mode=None: 0.0
def run_off():
    off = LLM(str(ll), device="cuda", dtype=dtype, enforce_eager="eagerold" in variant)
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    off.shutdown()
    print(variant, "after shutdown: allocated %.2f GiB" % (torch.cuda.memory_allocated() / 2**30), flush=True)
    return off, ref


if "off" in variant and "late" not in variant:
    off, ref = run_off()
    if "collect" in variant:  # the shut-down engine stays referenced; its cyclic garbage goes
        import gc
        gc.collect()
    if "gc" in variant:
        import gc
        del off
        gc.collect()
        torch.cuda.empty_cache()
spec = {"method": "draft_model", "model": str(dr), "num_speculative_tokens": 3}
kv = {"num_gpu_blocks_override": int(variant.split("kv")[1].split("_")[0])} if "kv" in variant else {}
llm = LLM(str(ll), device="cuda", dtype=dtype, speculative_config=spec, async_scheduling="async" in variant, **kv)
print(variant, "blocks", llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool.num_blocks, flush=True)
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
if "late" in variant:  # the spec engine first, then an engine without speculation, then it again
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    off, ref = run_off()
    del off
    import gc
    gc.collect()
    print(variant, "first OK", first == ref, flush=True)
try:
    outs = llm.generate(prompts, sp, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    print(variant, "OK", got == ref if "off" in variant else "", flush=True)
except Exception as e:
    print(variant, "FAILED", type(e).__name__, str(e)[:200], flush=True)
    traceback.print_exc(limit=40)
