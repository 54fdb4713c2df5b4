import gc
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, ".")
from pathlib import Path

import torch
from transformers import Qwen3Config

from pyengine import LLM, SamplingParams
from tests.helpers import build_tokenizer

d = Path(tempfile.mkdtemp())
build_tokenizer(d)
Qwen3Config(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
            rope_theta=1e6, architectures=["Qwen3ForCausalLM"], torch_dtype="bfloat16").save_pretrained(d)
rng = random.Random(0)
n = int(os.environ.get("N", 256))
prompts = [[rng.randint(0, 9999) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024), detokenize=False) for _ in range(n)]
res = {}
for async_on in [True, False]:
    t0 = time.perf_counter()
    llm = LLM(str(d), load_format="dummy", dtype="bfloat16", max_model_len=4096, async_scheduling=async_on)
    startup = time.perf_counter() - t0
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    dt = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    st = llm.llm_engine.get_stats()
    res[f"async={async_on}"] = dict(startup_s=startup, tok_s=toks / dt, time=dt, toks=toks,
                                    host_ms_per_step=1000 * st.step_host_time_s / max(st.num_steps, 1), steps=st.num_steps,
                                    graph_s=llm.llm_engine.engine_core.model_runner.graph_capture_time_s)
    print(res, flush=True)
    if async_on:
        # profile a few steps
        from torch.profiler import ProfilerActivity, profile
        eng = llm.llm_engine
        for i in range(64):
            eng.add_request(f"p{i}", prompts[i][:200], SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False))
        for _ in range(30):
            eng.step()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                eng.step()
        while eng.has_unfinished_requests():
            eng.step()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
        del eng, prof
    del llm, outs
    gc.collect()
    torch.cuda.empty_cache()
with open(os.environ.get("OUT", ".") + "/quick_tp.json", "w") as out:
    json.dump(res, out, indent=1)
