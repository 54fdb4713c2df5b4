"""Throughput of the C ABI against the Python API on the same workload.

    python benchmarks/capi_throughput.py --model MODEL_DIR [--requests 32] [--max-tokens 32]
    python benchmarks/capi_throughput.py --tiny      # builds the tests' tiny random llama first

Three runs, each in its own process, each timed from the first submit to the last
finished request (engine load excluded), greedy, ignore_eos (every request produces
exactly --max-tokens tokens):

- python:          AsyncLLM.add_request for all requests, DELTA outputs read with
                   collector.get() from one thread per request;
- c_submit:        vllm_request_submit for all requests from one C thread, callbacks on
                   the library's delivery threads, then vllm_request_wait for each;
- c_complete_stream: one C thread per request calling vllm_complete_stream.

``--kinds`` picks the runs (default all three); ``--lib`` runs a given libvengine.so
(whose embedded Python imports the checkout it was built from). The C runs also report
``threads_added``: the peak number of OS threads of the process during the run (sampled
from /proc/self/task every 2 ms) minus the number before the first submit; for
c_complete_stream that includes the host's own thread per request.

Prints one JSON line per run and a summary table. libvengine.so is built with
``capi.build`` into a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

C_DRIVER = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>
#include "vllm.h"

static atomic_long g_bytes, g_calls;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
/* OS threads of this process (/proc/self/task), sampled every 2 ms during the run */
static int count_threads(void) { DIR* d = opendir("/proc/self/task"); int n = 0; struct dirent* x; if (!d) return -1; while ((x = readdir(d))) n += x->d_name[0] != '.'; closedir(d); return n; }
static atomic_int g_sampling, g_threads_peak;
static void* sampler_main(void* a) { (void)a; while (atomic_load(&g_sampling)) { int n = count_threads(); if (n > atomic_load(&g_threads_peak)) atomic_store(&g_threads_peak, n); usleep(2000); } return NULL; }
static bool cb(const char* d, bool fin, void* ud) { (void)ud; (void)fin; atomic_fetch_add(&g_bytes, (long)strlen(d)); atomic_fetch_add(&g_calls, 1); return true; }

typedef struct { vllm_engine* e; const char* prompt; vllm_sampling_params sp; vllm_status st; } job;
static void* stream_main(void* a) { job* j = a; j->st = vllm_complete_stream(j->e, j->prompt, &j->sp, cb, NULL); return NULL; }

int main(int argc, char** argv) {
  const char* mode = argv[1]; const char* model = argv[2]; int n = atoi(argv[3]); int max_tokens = atoi(argv[4]);
  int max_num_seqs = atoi(argv[5]);
  char** prompts = argv + 6; int np = argc - 6;
  vllm_model_params mp = vllm_model_params_default();
  mp.model_path = model; mp.max_num_seqs = max_num_seqs;
  vllm_engine* e = NULL;
  if (vllm_engine_load(&mp, &e) != VLLM_OK) { fprintf(stderr, "load: %s\n", vllm_last_error()); return 1; }
  vllm_sampling_params sp = vllm_sampling_params_default();
  sp.temperature = 0; sp.max_tokens = max_tokens; sp.ignore_eos = 1;
  { vllm_completion c; vllm_complete(e, prompts[0], &sp, &c); vllm_completion_free(&c); } /* warm-up */
  atomic_store(&g_bytes, 0); atomic_store(&g_calls, 0);
  int threads_before = count_threads();
  atomic_store(&g_threads_peak, threads_before); atomic_store(&g_sampling, 1);
  pthread_t sampler; pthread_create(&sampler, NULL, sampler_main, NULL);
  double t0 = now();
  int failed = 0;
  if (!strcmp(mode, "c_submit")) {
    vllm_request** rs = calloc(n, sizeof *rs);
    for (int i = 0; i < n; i++)
      if (vllm_request_submit(e, prompts[i % np], &sp, cb, NULL, &rs[i]) != VLLM_OK) { fprintf(stderr, "%s\n", vllm_last_error()); return 1; }
    for (int i = 0; i < n; i++) { failed += vllm_request_wait(rs[i]) != VLLM_OK; vllm_request_free(rs[i]); }
    free(rs);
  } else {
    job* js = calloc(n, sizeof *js); pthread_t* th = calloc(n, sizeof *th);
    for (int i = 0; i < n; i++) { js[i].e = e; js[i].prompt = prompts[i % np]; js[i].sp = sp; pthread_create(&th[i], NULL, stream_main, &js[i]); }
    for (int i = 0; i < n; i++) { pthread_join(th[i], NULL); failed += js[i].st != VLLM_OK; }
    free(js); free(th);
  }
  double dt = now() - t0;
  atomic_store(&g_sampling, 0); pthread_join(sampler, NULL);
  /* threads_added: peak OS threads during the run minus those before the first submit
   * (the sampler thread itself excluded); for c_complete_stream it counts the host's own
   * per-request threads */
  printf("{\"run\": \"%s\", \"seconds\": %.4f, \"requests\": %d, \"output_tokens\": %d, \"callbacks\": %ld, \"bytes\": %ld, \"failed\": %d, \"threads_before\": %d, \"threads_added\": %d}\n",
         mode, dt, n, n * max_tokens, atomic_load(&g_calls), atomic_load(&g_bytes), failed, threads_before, atomic_load(&g_threads_peak) - threads_before - 1);
  vllm_engine_free(e);
  return failed != 0;
}
"""

PY_DRIVER = r"""
import json, sys, threading, time
from pyengine import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
model, n, max_tokens, max_num_seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompts = json.loads(sys.argv[5])
llm = AsyncLLM.from_engine_args(EngineArgs(model=model, max_num_seqs=max_num_seqs))
sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
for _ in llm.add_request("warm", prompts[0], sp): pass
stats = {"bytes": 0, "outputs": 0}
lock = threading.Lock()
def read(c):
    b = k = 0
    for out in c:
        b += len(out.outputs[0].text.encode()); k += 1
    with lock:
        stats["bytes"] += b; stats["outputs"] += k
t0 = time.monotonic()
cs = [llm.add_request(f"r{i}", prompts[i % len(prompts)], sp) for i in range(n)]
ts = [threading.Thread(target=read, args=(c,)) for c in cs]
for t in ts: t.start()
for t in ts: t.join()
dt = time.monotonic() - t0
print(json.dumps({"run": "python", "seconds": round(dt, 4), "requests": n, "output_tokens": n * max_tokens,
                  "callbacks": stats["outputs"], "bytes": stats["bytes"], "failed": 0}))
llm.shutdown()
"""

PROMPTS = ["def main():", "import os\nimport sys", "class Foo(object):", "for i in range(10):",
           "The quick brown fox", "if __name__ == '__main__':", "return self.value", "# TODO: fix"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--tiny", action="store_true", help="build and use the tests' tiny random llama")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each kind; the best is reported")
    ap.add_argument("--lib", help="use this libvengine.so instead of building one (e.g. to compare "
                                  "builds of two checkouts on the same model)")
    ap.add_argument("--kinds", default="python,c_submit,c_complete_stream",
                    help="comma-separated runs to make (python, c_submit, c_complete_stream)")
    args = ap.parse_args()
    from capi.build import build

    with tempfile.TemporaryDirectory(prefix="capi-bench-") as tmp:
        tmp = Path(tmp)
        model = args.model
        if args.tiny:
            from tests.helpers import build_tiny_model, build_tokenizer
            model = str(build_tiny_model(tmp / "llama", "llama", build_tokenizer(tmp / "tok"), seed=1))
        if not model:
            ap.error("--model or --tiny is required")
        lib = Path(args.lib).resolve() if args.lib else build(tmp / "lib")
        src = tmp / "driver.c"
        src.write_text(C_DRIVER)
        exe = tmp / "driver"
        subprocess.run(["gcc", "-O2", "-std=c11", "-pthread", f"-I{ROOT / 'include'}", str(src), "-o", str(exe),
                        f"-L{lib.parent}", "-lvengine", f"-Wl,-rpath,{lib.parent}"], check=True)
        common = [str(args.requests), str(args.max_tokens), str(args.max_num_seqs)]
        results = {}
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for _ in range(args.repeat):
            for kind in args.kinds.split(","):
                if kind == "python":
                    cmd = [sys.executable, "-c", PY_DRIVER, model, *common, json.dumps(PROMPTS)]
                else:
                    cmd = [str(exe), kind, model, *common, *PROMPTS]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    print(proc.stdout, proc.stderr, file=sys.stderr)
                    return 1
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                r["tokens_per_s"] = round(r["output_tokens"] / r["seconds"], 1)
                print(json.dumps(r), flush=True)
                results.setdefault(kind, []).append(r)
        best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in results.items()}
        med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
        print(f"\n{args.requests} requests x {args.max_tokens} tokens, {args.repeat} run(s) each")
        base = best.get("python")
        print(f"{'run':<20}{'best tok/s':>12}{'median tok/s':>14}{'best vs python':>16}{'callbacks':>11}"
              f"{'threads added':>15}")
        for kind in results:
            ratio = f"{best[kind]['tokens_per_s'] / base['tokens_per_s']:>15.2f}x" if base else f"{'-':>16}"
            added = max(r.get("threads_added", -1) for r in results[kind])
            print(f"{kind:<20}{best[kind]['tokens_per_s']:>12.1f}{med[kind]:>14.1f}{ratio}"
                  f"{best[kind]['callbacks']:>11}{added if added >= 0 else '-':>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
