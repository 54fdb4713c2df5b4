"""Front-end capacity: how many streamed tokens/s one front-end process can deliver when
the engine core is infinitely fast.

A stand-in engine core (``FakeCore``, an ``EngineCoreClient``) answers every
``get_output`` with one new token for each running request, round-tripped through the
cbor2 codec as the multi-process client receives it, optionally paced to one step per
``--step-ms`` (a GPU step). Everything after that is the real front end: ``AsyncLLM``'s
output handler (OutputProcessor: detokenization, stop checks; collectors), then the
readers: asyncio ``generate`` streams, the HTTP server (``server.wsgi``) streaming
SSE to clients in other processes, or the C ABI's Python side (``capi._impl._Bridge``:
the per-step drain of the collectors into one ``vg_push`` batch; ``vg_push`` itself, and
the C delivery threads that run without the GIL, are replaced by a recorder). The figure is the front end's own ceiling, in tokens
per second and microseconds of front-end time per token, independent of the GPU:

    python benchmarks/frontend.py --streams 256 --tokens 256 --readers asyncio,http,capi

``--step-ms`` paces the stand-in core (one step per that many ms, as a GPU step); unpaced,
readers that fall behind get merged deltas (see tokens/event).

Per-thread CPU time of the process (``/proc/self/task``) is printed for each run:
which thread the time goes to.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from pathlib import Path

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from pyengine.codec import decode, encode  # noqa: E402
from pyengine.engine.core_client import EngineCoreClient  # noqa: E402
from pyengine.messages import (  # noqa: E402
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreShutdown,
    EngineDeadMessage,
    SchedulerStats,
)


class FakeCore(EngineCoreClient):
    """An engine core that samples a random token per running request per step."""

    def __init__(self, config, step_s: float = 0.0, max_num_seqs: int = 256, seed: int = 0):
        super().__init__()
        self.ready = EngineCoreReady(SchedulerStats(num_gpu_blocks=1000, num_free_blocks=1000))
        self.vocab = config.hf_config.vocab_size
        self.step_s, self.max_num_seqs = step_s, max_num_seqs
        self.rng = random.Random(seed)
        self.inbox: list = []
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.running: dict[str, list] = {}  # id -> [generated, max_tokens, first]
        self.waiting: list = []
        self.stop = False
        self.steps = 0
        self.core_time_s = 0.0  # encode + decode of the step's message (the core's share and ours)

    def _send(self, msg) -> None:
        with self.cond:
            self.inbox.append(msg)
            self.cond.notify()

    def wait_ready(self) -> None:
        pass

    def get_output(self, timeout: float | None = None):
        t_start = time.perf_counter()
        with self.cond:
            while not self.inbox and not self.running and not self.waiting and not self.stop:
                if not self.cond.wait(timeout):
                    return None
            inbox, self.inbox = self.inbox, []
        if self.stop:
            return EngineDeadMessage("shut down")
        aborted = []
        for m in inbox:
            if isinstance(m, EngineCoreRequest):
                self.waiting.append(m)
            elif isinstance(m, EngineCoreAbort):
                for rid in m.request_ids:
                    if self.running.pop(rid, None) is not None:
                        aborted.append(rid)
                self.waiting = [w for w in self.waiting if w.request_id not in m.request_ids]
            elif isinstance(m, EngineCoreShutdown):
                self.stop = True
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            self.running[r.request_id] = [0, r.max_tokens]
        outs = [EngineCoreOutput(rid, [], finish_reason="abort") for rid in aborted]
        done = []
        rand = self.rng.randrange
        for rid, st in self.running.items():
            st[0] += 1
            fin = st[0] >= st[1]
            outs.append(EngineCoreOutput(rid, [rand(8, self.vocab)], finish_reason="length" if fin else None))
            if fin:
                done.append(rid)
        for rid in done:
            del self.running[rid]
        self.steps += 1
        t0 = time.perf_counter()
        msg = decode(encode(EngineCoreOutputs(outs, SchedulerStats(num_running=len(self.running)), time.monotonic())))
        self.core_time_s += time.perf_counter() - t0
        if self.step_s:
            left = self.step_s - (time.perf_counter() - t_start)
            if left > 0:
                time.sleep(left)
        return msg

    def wake_output_reader(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def is_alive(self) -> bool:
        return not self.stop

    def shutdown(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread name of this process (native ids mapped to Python names)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        f = stat.rsplit(")", 1)[1].split()
        name = names.get(int(tid), "native")
        out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / tick
    return out


def make_engine(model_dir: str, step_ms: float, max_num_seqs: int, stream_interval: int | None):
    from pyengine import AsyncLLM, EngineArgs
    from pyengine.engine import async_llm

    kw = {"model": model_dir, "device": "cpu", "max_num_seqs": max_num_seqs}
    if stream_interval:
        kw["stream_interval"] = stream_interval
    cfg = EngineArgs(**kw).create_engine_config()
    orig = async_llm.make_client
    async_llm.make_client = lambda config, mp=None, wait=True: FakeCore(config, step_ms / 1e3, max_num_seqs)
    try:
        return AsyncLLM(cfg)
    finally:
        async_llm.make_client = orig


def run_asyncio(engine, streams: int, tokens: int, prompt_len: int) -> dict:
    from benchmarks.serve import make_workload, run_in_process, summarize

    reqs = make_workload(streams, prompt_len, tokens, engine.config.hf_config.vocab_size, 0)
    res, dur = run_in_process(engine, reqs, streams, math.inf, 0)
    return summarize(res, dur)


def run_http(engine, streams: int, tokens: int, prompt_len: int, clients: int) -> dict:
    from types import SimpleNamespace

    from benchmarks.serve import _http_level, make_workload, summarize
    from server import BackgroundServer, create_app

    srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=["m"])), port=0).start()
    try:
        reqs = make_workload(streams, prompt_len, tokens, engine.config.hf_config.vocab_size, 0)
        res, dur = _http_level(srv.base_url, {"http_clients": clients, "seed": 0}, reqs, streams)
        s = summarize(res, dur)
        s["thread_cpu"] = thread_cpu()  # before the server's thread ends (its time goes with it)
        return s
    finally:
        srv.stop()


def run_capi(engine, streams: int, tokens: int, prompt_len: int) -> dict:
    """``vllm_request_submit`` streams as the C ABI's Python side serves them: a host
    thread validates every request (``Processor.process``, as ``vllm_request_submit``) and
    submits it through ``_Bridge.submit``; the output thread's listener
    drains the collectors and calls ``vg_push`` once per step, here a recorder of each
    delta's request, token count, finish flag and time (the real one copies into C and
    returns; the C delivery threads need no GIL)."""
    import cffi

    from benchmarks.serve import Result, make_workload, summarize
    from capi import _impl
    from capi.build import _CDEF_TAIL
    from pyengine import RequestOutputKind, SamplingParams

    ffi = cffi.FFI()
    ffi.cdef(_CDEF_TAIL.split("void vg_push", 1)[0])
    steps: list = []  # (time, vg_delta[] kept alive, n)
    done = threading.Event()
    left = [streams]

    class Lib:
        @staticmethod
        def vg_push(arr, n):
            steps.append((time.perf_counter(), arr, n))
            for i in range(n):
                if arr[i].finished:
                    left[0] -= 1
            if left[0] <= 0:
                done.set()

    old = _impl.ffi, _impl.lib
    _impl.ffi, _impl.lib = ffi, Lib
    bridge = _impl._Bridge(engine)
    try:
        reqs = make_workload(streams, prompt_len, tokens, engine.config.hf_config.vocab_size, 0)
        results = [Result(False, len(r.prompt)) for r in reqs]
        sent: list = [0.0] * len(reqs)
        t0 = time.perf_counter()
        for i, r in enumerate(reqs):
            sp = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
            sent[i] = time.perf_counter()
            results[i].start = time.time()
            bridge.submit(ffi.cast("void*", i + 1), engine.processor.process(_impl._request_id(i), r.prompt, sp, 0))
        if not done.wait(600):
            raise RuntimeError("C ABI streams did not finish")
        dur = time.perf_counter() - t0
        last: list = [None] * len(reqs)
        for t, arr, n in steps:
            for j in range(n):
                d = arr[j]
                i = int(ffi.cast("intptr_t", d.req)) - 1
                res = results[i]
                res.events += 1
                if d.n_tokens:
                    res.output_tokens += d.n_tokens
                    if last[i] is None:
                        res.ttft = t - sent[i]
                    else:
                        res.itls.append(t - last[i])
                    last[i] = t
                if d.finished:
                    res.ok, res.e2e, res.end = d.status == 0, t - sent[i], time.time()
        return summarize(results, dur)
    finally:
        bridge.drain.close()
        _impl.ffi, _impl.lib = old


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=None, help="default: the Qwen3-0.6B shape's dir (full-vocab tokenizer)")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--readers", default="asyncio,http")
    p.add_argument("--step-ms", type=float, default=0.0, help="pace the fake core (0: as fast as the front end takes)")
    p.add_argument("--stream-interval", type=int, default=None)
    p.add_argument("--http-clients", type=int, default=4)
    p.add_argument("--json", dest="json_out", default=None)
    a = p.parse_args(argv)
    from benchmarks.common import default_model_dir, make_model_dir

    model_dir = a.model_dir or str(make_model_dir("qwen3-0.6b", default_model_dir("qwen3-0.6b")))
    results = {}
    for reader in a.readers.split(","):
        engine = make_engine(model_dir, a.step_ms, a.streams, a.stream_interval)
        try:
            cpu0, t0 = thread_cpu(), time.perf_counter()
            fake = engine.engine_core
            steps0, core0 = fake.steps, fake.core_time_s
            if reader == "asyncio":
                s = run_asyncio(engine, a.streams, a.tokens, a.prompt_len)
            elif reader == "http":
                s = run_http(engine, a.streams, a.tokens, a.prompt_len, a.http_clients)
            elif reader == "capi":
                s = run_capi(engine, a.streams, a.tokens, a.prompt_len)
            else:
                raise SystemExit(f"unknown reader {reader!r} (asyncio, http, capi)")
            wall = time.perf_counter() - t0
            cpu1 = s.pop("thread_cpu", None) or thread_cpu()
            cpu = {k: round(v - cpu0.get(k, 0.0), 3) for k, v in cpu1.items() if v - cpu0.get(k, 0.0) > 0.005}
            toks = s["output_tokens"]
            r = {"output_tok_s": s["output_throughput"], "tokens": toks, "wall_s": wall,
                 "steps": fake.steps - steps0, "codec_s": fake.core_time_s - core0,
                 "us_per_token_cpu": 1e6 * sum(cpu.values()) / max(toks, 1), "thread_cpu_s": cpu,
                 "tokens_per_event": s["tokens_per_event"], "p50_itl_ms": s["p50_itl_ms"],
                 "p50_ttft_ms": s["p50_ttft_ms"], "failed": s["failed"]}
            results[reader] = r
            print(f"{reader}: {r['output_tok_s']:,.0f} tok/s, {r['us_per_token_cpu']:.1f} us CPU/token, "
                  f"{r['tokens_per_event']:.2f} tok/event, TTFT p50 {r['p50_ttft_ms']:.0f} ms, "
                  f"ITL p50 {r['p50_itl_ms']:.1f} ms, steps {r['steps']}, failed {r['failed']}, threads {cpu}",
                  flush=True)
        finally:
            engine.shutdown()
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
