"""Serving benchmark: every front end against the offline ceiling, in one run.

``--suite`` (what docs/benchmarks.md records) runs one workload through

* ``offline``  — ``LLM.generate`` with every prompt at once: the ceiling;
* ``asyncllm`` — ``AsyncLLM.generate`` asyncio streams in one process;
* ``http``     — ``vengine serve`` streaming ``/v1/completions`` to clients spread over
  ``--http-clients`` other processes (one Python client cannot parse 50k SSE events/s);
  ``http-xN`` the same with ``--api-server-count N``, ``http-auto`` with the server's own
  choice (``auto_api_server_count``); ``http-aio`` (``http-aio-xN``) the same through an
  aiohttp client shaped like ``vllm bench serve``'s (pooled keep-alive connections, TTFT
  at the first chunk with ``choices``) instead of this file's raw-socket one;
* ``capi``     — ``vllm_request_submit`` streams from a C host (``libvengine.so``),

each in its own process, for each engine core (``--cores inproc,mp``: the engine loop on a
thread of the front end's process, or in its own process), at each concurrency
(``--concurrency 1,64,256``), with TTFT / TPOT / ITL percentiles, and prints every ratio
to the offline rate of the same run. ``--profile C`` also samples the front end's
process(es) with py-spy during an extra run at concurrency C: per thread, the share of
wall time on CPU and holding the GIL, and the hottest frames.

    python benchmarks/serve.py --suite --json serve.json                    # H200, Qwen3-0.6B shape
    python benchmarks/serve.py --suite --device cpu --shape tiny --concurrency 1,16 \\
        --num-prompts 32 --output-len 32 --frontends offline,asyncllm,http

The workload (the issue's): ``--num-prompts`` prompts of ``--input-len`` random token ids,
``--output-len`` tokens each, greedy, ``ignore_eos``; concurrency 1 runs
``--c1-prompts`` of them. The C host submits text prompts (the same ids decoded), so its
prompts are within a few tokens of the others'. Every front end gets the same engine
arguments (``--max-model-len``, ``--max-num-seqs``, ``--device``, ...; the C host through
``vllm_model_params``, and a run whose arguments the C ABI cannot carry, such as a dtype
other than the checkpoint's, is refused for it). Weights are random (bf16 on CUDA), written
once to the model directory so that every front end, the C ABI included, loads the same.

Also a plain HTTP client for a running server (``--base-url``, in the manner of
``vllm bench serve``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

FRONTENDS = ("offline", "asyncllm", "http", "capi")
CORES = ("inproc", "mp")
# The engine-core switch the child processes get (pyengine reads it when it builds a client).
CORE_ENV = "VENGINE_ENABLE_MULTIPROCESSING"

# ----------------------------------------------------------------------------------------
# Workload and results


@dataclass
class Req:
    prompt: list[int]
    output_len: int


def make_workload(num: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                  dataset: str = "fixed", range_ratio: float = 0.0, skip_ids: int = 8) -> list[Req]:
    """Token-id prompts (exact lengths, no tokenizer round trip). ``dataset="random"``
    draws lengths uniformly in ``[L*(1-r), L*(1+r)]``; ``"fixed"`` uses ``L`` exactly."""
    rng = random.Random(seed)
    lo_id, hi_id = skip_ids, max(skip_ids + 1, min(vocab_size, 10000) - 1)
    out = []
    for _ in range(num):
        il, ol = input_len, output_len
        if dataset == "random" and range_ratio > 0:
            il = rng.randint(max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio))))
            ol = rng.randint(max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio))))
        out.append(Req([rng.randint(lo_id, hi_id) for _ in range(il)], ol))
    return out


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list = field(default_factory=list)
    start: float = 0.0  # time.time() at send (merging results of several client processes)
    end: float = 0.0
    events: int = 0  # SSE events / deltas received
    bytes: int = 0  # SSE bytes received (HTTP)
    error: str = ""


def _pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    f, c = math.floor(k), math.ceil(k)
    return xs[f] if f == c else xs[f] + (xs[c] - xs[f]) * (k - f)


def summarize(results: list[Result], duration: float, percentiles=(50, 90, 99)) -> dict:
    good = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in good)
    in_tok = sum(r.prompt_len for r in good)
    ttfts = [r.ttft * 1000 for r in good]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) * 1000 for r in good if r.output_tokens > 1]
    itls = [x * 1000 for r in good for x in r.itls]
    e2es = [r.e2e * 1000 for r in good]
    events = sum(r.events for r in good)
    s = {"completed": len(good), "failed": len(results) - len(good), "duration_s": duration,
         "input_tokens": in_tok, "output_tokens": out_tok,
         "request_throughput": len(good) / duration if duration else 0.0,
         "output_throughput": out_tok / duration if duration else 0.0,
         "total_token_throughput": (in_tok + out_tok) / duration if duration else 0.0,
         "events": events, "tokens_per_event": out_tok / events if events else float("nan"),
         "bytes_per_event": sum(r.bytes for r in good) / events if events and any(r.bytes for r in good)
         else float("nan")}
    for name, xs in (("ttft_ms", ttfts), ("tpot_ms", tpots), ("itl_ms", itls), ("e2e_ms", e2es)):
        s[f"mean_{name}"] = statistics.fmean(xs) if xs else float("nan")
        for p in percentiles:
            s[f"p{p}_{name}"] = _pct(xs, p)
    errors = [r.error for r in results if not r.ok][:3]
    if errors:
        s["errors"] = errors
    return s


def print_summary(title: str, s: dict) -> None:
    print(f"============ {title} ============")
    print(f"requests ok/failed: {s['completed']}/{s['failed']}  duration {s['duration_s']:.2f} s  "
          f"output {s['output_throughput']:.1f} tok/s  tokens/event {s['tokens_per_event']:.2f}")
    for name, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        ps = "  ".join(f"p{k[1:].split('_')[0]}={v:.2f}" for k, v in s.items()
                       if k.startswith("p") and k.endswith(name))
        print(f"{label:5s} (ms): mean={s[f'mean_{name}']:.2f}  {ps}")
    for e in s.get("errors", []):
        print(f"error: {e}")
    sys.stdout.flush()


def _arrival_gaps(n: int, rate: float, seed: int):
    rng = random.Random(seed + 1)
    for _ in range(n):
        yield 0.0 if math.isinf(rate) else rng.expovariate(rate)


# ----------------------------------------------------------------------------------------
# HTTP client (gevent greenlets on raw sockets: hundreds of streams cost the client little)


def _read_response_head(sock, buf: bytes) -> tuple[int, bool, bytes]:
    while b"\r\n\r\n" not in buf:
        d = sock.recv(65536)
        if not d:
            raise ConnectionError("connection closed before the response headers")
        buf += d
    head, buf = buf.split(b"\r\n\r\n", 1)
    return int(head.split(b" ", 2)[1]), b"transfer-encoding: chunked" in head.lower(), buf


def _dechunk(body_buf: bytes, events_buf: bytes) -> tuple[bytes, bytes, bool]:
    """Move whole chunks from ``body_buf`` to ``events_buf``; True once the last chunk came."""
    while True:
        i = body_buf.find(b"\r\n")
        if i < 0:
            return body_buf, events_buf, False
        size = int(body_buf[:i].split(b";")[0], 16)
        if len(body_buf) < i + 2 + size + 2:
            return body_buf, events_buf, False
        if size == 0:
            return b"", events_buf, True
        events_buf += body_buf[i + 2:i + 2 + size]
        body_buf = body_buf[i + 2 + size + 2:]


def _on_event(data: bytes, res: Result, state: dict) -> bool:
    """One SSE ``data:`` payload; True at ``[DONE]``."""
    if data == b"[DONE]":
        return True
    obj = json.loads(data)
    if "error" in obj:
        raise RuntimeError(f"stream error: {obj['error'].get('message')}")
    if obj.get("usage") and not obj.get("choices"):
        res.output_tokens = obj["usage"]["completion_tokens"]
        return False
    res.events += 1
    res.bytes += len(data) + 8
    ch = obj["choices"][0]
    text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
    if text:
        now = time.perf_counter()
        if state["last"] is None:
            res.ttft = now - state["t_send"]
        else:
            res.itls.append(now - state["last"])
        state["last"] = now
    return False


def _http_stream(host: str, port: int, path: str, body: bytes, headers: dict, res: Result) -> None:
    from gevent import socket as gsocket

    res.start, t_send = time.time(), time.perf_counter()
    sock = gsocket.create_connection((host, port))
    try:
        sock.setsockopt(gsocket.IPPROTO_TCP, gsocket.TCP_NODELAY, 1)
        hdr = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n{hdr}\r\n").encode() + body)
        status, chunked, body_buf = _read_response_head(sock, b"")
        events_buf, eof, state = b"", False, {"last": None, "t_send": t_send}
        while not eof:
            if chunked:
                body_buf, events_buf, eof = _dechunk(body_buf, events_buf)
            else:
                events_buf, body_buf = events_buf + body_buf, b""
            while b"\n\n" in events_buf:
                ev, events_buf = events_buf.split(b"\n\n", 1)
                if status == 200 and ev.startswith(b"data: ") and _on_event(ev[6:], res, state):
                    eof = True
                    break
            if eof:
                break
            d = sock.recv(65536)
            if not d:
                break
            body_buf += d
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(body_buf + events_buf)[:200]!r}")
        res.e2e = time.perf_counter() - t_send
        res.end = time.time()
        res.ok = True
    finally:
        sock.close()


def run_http(base_url: str, reqs: list[Req], model: str | None, endpoint: str, max_concurrency: int | None,
             request_rate: float, seed: int, api_key: str | None, ignore_eos: bool = True,
             start_at: float | None = None) -> tuple[list, float]:
    """Stream every request; returns (results, seconds from the first send to the last end)."""
    import gevent
    from gevent.pool import Pool

    u = urlparse(base_url)
    host, port = u.hostname, u.port or 80
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    chat = "chat" in endpoint
    results = [Result(False, len(r.prompt)) for r in reqs]

    def one(i: int, r: Req):
        payload = {"max_tokens": r.output_len, "stream": True, "temperature": 0.0, "ignore_eos": ignore_eos,
                   "stream_options": {"include_usage": True}}
        if model:
            payload["model"] = model
        if chat:  # chat prompts are text: the ids are only used for their count
            payload["messages"] = [{"role": "user", "content": " ".join(str(t) for t in r.prompt)}]
        else:
            payload["prompt"] = r.prompt
        try:
            _http_stream(host, port, endpoint, json.dumps(payload).encode(), headers, results[i])
        except Exception as e:  # noqa: BLE001 - counted as a failed request
            results[i].ok, results[i].error = False, f"{type(e).__name__}: {e}"

    if start_at is not None:
        gevent.sleep(max(0.0, start_at - time.time()))
    pool = Pool(max_concurrency or len(reqs) or 1)
    t0 = time.perf_counter()
    for i, (r, gap) in enumerate(zip(reqs, _arrival_gaps(len(reqs), request_rate, seed))):
        if gap:
            gevent.sleep(gap)
        pool.spawn(one, i, r)
    pool.join()
    return results, time.perf_counter() - t0


def run_http_aiohttp(base_url: str, reqs: list[Req], model: str | None, endpoint: str,
                     max_concurrency: int | None, request_rate: float, seed: int, api_key: str | None,
                     ignore_eos: bool = True, start_at: float | None = None) -> tuple[list, float]:
    """The same requests through an aiohttp client shaped like ``vllm bench serve``'s
    (vllm/benchmarks/lib/endpoint_request_func.py): one ``ClientSession`` whose connector
    pools keep-alive connections (``limit`` = the concurrency), each stream read by lines
    of ``response.content``, TTFT taken at the first chunk that has ``choices`` (empty text
    or not), ITL between later such chunks. Returns (results, seconds from the first send
    to the last end)."""
    import asyncio

    import aiohttp

    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    chat = "chat" in endpoint
    results = [Result(False, len(r.prompt)) for r in reqs]

    async def one(session, sem, i: int, r: Req):
        payload = {"max_tokens": r.output_len, "stream": True, "temperature": 0.0, "ignore_eos": ignore_eos,
                   "stream_options": {"include_usage": True}}
        if model:
            payload["model"] = model
        if chat:
            payload["messages"] = [{"role": "user", "content": " ".join(str(t) for t in r.prompt)}]
        else:
            payload["prompt"] = r.prompt
        res = results[i]
        async with sem:
            res.start, st = time.time(), time.perf_counter()
            last = None
            try:
                async with session.post(url, json=payload, headers=headers) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]!r}")
                    async for line in resp.content:
                        chunk = line.strip()
                        if not chunk.startswith(b"data: "):
                            continue
                        data = chunk[6:]
                        if data == b"[DONE]":
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            raise RuntimeError(f"stream error: {obj['error'].get('message')}")
                        if obj.get("choices"):
                            now = time.perf_counter()
                            if last is None:
                                res.ttft = now - st
                            else:
                                res.itls.append(now - last)
                            last = now
                            res.events += 1
                            res.bytes += len(chunk) + 2
                        elif obj.get("usage"):
                            res.output_tokens = obj["usage"]["completion_tokens"]
                res.e2e = time.perf_counter() - st
                res.end = time.time()
                res.ok = True
            except Exception as e:  # noqa: BLE001 - counted as a failed request
                res.ok, res.error = False, f"{type(e).__name__}: {e}"

    async def main() -> float:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        limit = max_concurrency or len(reqs) or 1
        sem = asyncio.Semaphore(limit)
        conn = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60, enable_cleanup_closed=True)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as session:
            t0 = time.perf_counter()
            tasks = []
            for i, (r, gap) in enumerate(zip(reqs, _arrival_gaps(len(reqs), request_rate, seed))):
                if gap:
                    await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(one(session, sem, i, r)))
            await asyncio.gather(*tasks)
            return time.perf_counter() - t0

    return results, asyncio.run(main())


HTTP_CLIENTS = {"own": run_http, "aiohttp": run_http_aiohttp}


# ----------------------------------------------------------------------------------------
# In-process client (AsyncLLM, asyncio)


def run_in_process(engine, reqs: list[Req], max_concurrency: int | None, request_rate: float, seed: int,
                   ignore_eos: bool = True, sampling: dict | None = None,
                   token_ids: list | None = None) -> tuple[list, float]:
    """``reqs`` streamed through ``engine.generate`` (greedy, DELTA outputs); ``sampling``:
    more SamplingParams fields; ``token_ids``: a list that gets each request's output ids."""
    import asyncio
    import uuid

    from pyengine import RequestOutputKind, SamplingParams

    results = [Result(False, len(r.prompt)) for r in reqs]
    if token_ids is not None:
        token_ids[:] = [[] for _ in reqs]

    async def one(i: int, r: Req, sem):
        async with sem:
            res = results[i]
            sp = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=ignore_eos,
                                output_kind=RequestOutputKind.DELTA, **(sampling or {}))
            res.start, t_send = time.time(), time.perf_counter()
            last = None
            try:
                async for out in engine.generate(r.prompt, sp, f"bench-{uuid.uuid4().hex}"):
                    now = time.perf_counter()
                    o = out.outputs[0]
                    res.output_tokens += len(o.token_ids)
                    res.events += 1
                    if token_ids is not None:
                        token_ids[i].extend(o.token_ids)
                    if o.token_ids:
                        if last is None:
                            res.ttft = now - t_send
                        else:
                            res.itls.append(now - last)
                        last = now
                res.e2e = time.perf_counter() - t_send
                res.end = time.time()
                res.ok = True
            except Exception as e:  # noqa: BLE001
                res.error = f"{type(e).__name__}: {e}"

    async def main():
        sem = asyncio.Semaphore(max_concurrency or len(reqs) or 1)
        tasks = []
        t0 = time.perf_counter()
        for i, (r, gap) in enumerate(zip(reqs, _arrival_gaps(len(reqs), request_rate, seed))):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(one(i, r, sem)))
        await asyncio.gather(*tasks)
        return time.perf_counter() - t0

    duration = asyncio.run(main())
    return results, duration


# ----------------------------------------------------------------------------------------
# Profiling (py-spy): per thread, the share of samples on CPU and holding the GIL


def find_py_spy(explicit: str | None = None) -> str | None:
    for cand in (explicit, shutil.which("py-spy"), os.path.join(os.path.dirname(sys.executable), "py-spy")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    for p in sys.path:  # installed with --target DIR: DIR/bin/py-spy
        cand = os.path.join(p, "bin", "py-spy")
        if p and os.path.isfile(cand):
            return cand
    return None


def parse_py_spy_raw(text: str, top: int = 12) -> dict:
    """py-spy's raw (collapsed-stack) output -> per (process, thread) sample counts, the
    hottest leaf frames and the hottest functions anywhere on the stack. With
    ``--subprocesses`` a stack starts with the chain of processes, the sampled one last:
    the profiled process is "frontend", a process of multiprocessing's forkserver (the
    engine core) "engine", a spawned one (an API server of ``--api-server-count``) "api",
    any other descendant "child"."""
    threads: dict[str, dict] = {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        name = thread.split(": ", 1)[-1] if ": " in thread else thread
        pid = re.match(r"process (\d+)", procs[-1]) if procs else None
        role = ("frontend" if len(procs) <= 1 else "engine" if "forkserver" in procs[-1]
                else "api" if "spawn_main" in procs[-1] else "child")
        key = f"{role}({pid.group(1) if pid else '?'}):{name}"
        code = [f for f in frames if not f.startswith(("process ", "thread "))]
        t = threads.setdefault(key, {"samples": 0, "leaf": {}, "inclusive": {}})
        n = int(count)
        t["samples"] += n
        if code:
            leaf = code[-1]
            t["leaf"][leaf] = t["leaf"].get(leaf, 0) + n
            for f in set(re.sub(r" \(.*", "", x) for x in code):
                t["inclusive"][f] = t["inclusive"].get(f, 0) + n
    for t in threads.values():  # inclusive: deeper, the first frames are every stack's bootstrap
        for k, n in (("leaf", top), ("inclusive", 3 * top)):
            t[k] = dict(sorted(t[k].items(), key=lambda kv: -kv[1])[:n])
    return threads


def profile_process(pid: int, seconds: float, py_spy: str, rate: int = 200) -> dict:
    """Two py-spy passes over ``pid`` and its children: GIL holders, then on-CPU threads.
    Shares are samples / (rate x seconds)."""
    out = {"rate": rate, "seconds": seconds}
    for mode, flags in (("gil", ["--gil"]), ("active", [])):
        with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as f:
            path = f.name
        cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
               "--threads", "--subprocesses", "--nonblocking", "--format", "raw", "-o", path, *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            out[mode] = {"error": (proc.stderr or proc.stdout)[-500:]}
            continue
        threads = parse_py_spy_raw(Path(path).read_text())
        os.unlink(path)
        total = rate * int(seconds)
        for t in threads.values():
            t["share"] = round(t["samples"] / total, 3)
        out[mode] = dict(sorted(threads.items(), key=lambda kv: -kv[1]["samples"]))
    return out


class _Profiler:
    """Starts ``profile_process`` on a thread ``delay`` s from now (inside a measured run)."""

    def __init__(self, pid: int, py_spy: str | None, seconds: float, delay: float = 1.0):
        self.result: dict | None = None
        if not py_spy:
            self.result = {"error": "py-spy not found"}
            self.thread = None
            return

        def run():
            time.sleep(delay)
            self.result = profile_process(pid, seconds, py_spy)
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> dict | None:
        if self.thread is not None:
            self.thread.join()
        return self.result


# ----------------------------------------------------------------------------------------
# Suite: one child process per (core, front end)


def _child_spec(a, frontend: str, core: str, model_dir: str) -> dict:
    return {"frontend": frontend, "core": core, "model": model_dir, "device": a.device,
            "dtype": a.dtype or ("bfloat16" if a.device == "cuda" else "float32"),
            "max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len,
            "levels": [int(x) for x in a.concurrency.split(",")], "num_prompts": a.num_prompts,
            "c1_prompts": a.c1_prompts, "input_len": a.input_len, "output_len": a.output_len,
            "seed": a.seed, "http_clients": a.http_clients, "profile": a.profile,
            "profile_seconds": a.profile_seconds, "py_spy": find_py_spy(a.py_spy),
            "switch_interval": a.switch_interval, "stream_interval": a.stream_interval, "repeats": a.repeats,
            "no_async_scheduling": a.no_async_scheduling}


def _level_prompts(spec: dict, c: int) -> int:
    return spec["c1_prompts"] if c == 1 else max(spec["num_prompts"], c)


def _engine_kwargs(spec: dict) -> dict:
    """The engine arguments (``EngineArgs`` keywords) of every front end of a run: the
    offline and asyncllm children pass them as they are, the server gets them as flags
    (``_serve_cmd``), the C host as ``vllm_model_params`` fields (``capi_engine_params``)."""
    kw = {"model": spec["model"], "device": spec["device"], "dtype": spec["dtype"],
          "max_num_seqs": spec["max_num_seqs"], "seed": spec["seed"]}
    if spec.get("max_model_len"):
        kw["max_model_len"] = spec["max_model_len"]
    if spec.get("no_async_scheduling"):
        kw["async_scheduling"] = False
    if spec.get("stream_interval"):
        kw["stream_interval"] = spec["stream_interval"]
    return kw


def _vocab(model_dir: str) -> int:
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model_dir).vocab_size


def _profile_prompts(spec: dict, tok_s: float) -> int:
    """Enough requests at the profiled concurrency to outlast both py-spy passes."""
    need_s = 2 * spec["profile_seconds"] + 4
    return max(spec["num_prompts"], int(math.ceil(need_s * max(tok_s, 1.0) / spec["output_len"])))


def child_offline(spec: dict) -> dict:
    from pyengine import LLM, SamplingParams

    llm = LLM(**_engine_kwargs(spec))
    reqs = make_workload(spec["num_prompts"], spec["input_len"], spec["output_len"], _vocab(spec["model"]),
                         spec["seed"])
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=spec["output_len"])
    llm.generate([r.prompt for r in reqs[:8]], sp, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(_repeats(spec)):
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({"completed": len(outs), "failed": 0, "duration_s": dt, "output_tokens": toks,
                     "output_throughput": toks / dt})
    levels = {"all": median_run(runs)}
    for c in spec["levels"]:
        level_reqs = make_workload(_level_prompts(spec, c), spec["input_len"], spec["output_len"],
                                   _vocab(spec["model"]), spec["seed"])  # the streamed levels' requests
        levels[str(c)] = median_run([_offline_closed_loop(llm, level_reqs, sp, c) for _ in range(_repeats(spec))])
        print(f"offline, at most {c} in flight: {levels[str(c)]['output_throughput']:,.0f} tok/s", flush=True)
    prof = None
    c = spec.get("profile")
    if c:  # the closed loop once more under py-spy: this process and the engine core's
        tok_s = levels.get(str(c), {}).get("output_throughput", 10000.0)
        reqs = make_workload(_profile_prompts(spec, tok_s), spec["input_len"], spec["output_len"],
                             _vocab(spec["model"]), spec["seed"] + 7)
        p = _Profiler(os.getpid(), spec["py_spy"], spec["profile_seconds"])
        prof = {"concurrency": c, "run": _offline_closed_loop(llm, reqs, sp, c), "py_spy": p.join()}
    llm.shutdown()
    return {"levels": levels, "profile": prof}


def _offline_closed_loop(llm, reqs: list[Req], sp, concurrency: int) -> dict:
    """The offline rate at a concurrency: ``LLMEngine.step`` in a loop with at most
    ``concurrency`` requests in flight, the next one added as soon as one finishes (what
    the streamed front ends' closed-loop clients do, without streaming): the fair ceiling
    for a front end at that concurrency."""
    from pyengine import RequestOutputKind

    engine, todo = llm.llm_engine, list(reversed(reqs))
    params = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
    in_flight, toks, n = 0, 0, 0
    t0 = time.perf_counter()
    while todo or in_flight:
        while todo and in_flight < concurrency:
            engine.add_request(f"closed-{concurrency}-{n}", todo.pop().prompt, params)
            in_flight, n = in_flight + 1, n + 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                toks += len(out.outputs[0].token_ids)
    dt = time.perf_counter() - t0
    return {"completed": n, "failed": 0, "duration_s": dt, "output_tokens": toks, "output_throughput": toks / dt}


def _repeats(spec: dict) -> int:
    return max(int(spec.get("repeats") or 1), 1)


def median_run(runs: list[dict]) -> dict:
    """The run of median output throughput (the lower middle one of an even count), with
    every run's throughput beside it (``runs_tok_s``, in run order): one engine, the same
    requests each time, so the spread is the machine's noise, not a start-up's."""
    mid = sorted(runs, key=lambda r: r["output_throughput"])[(len(runs) - 1) // 2]
    return {**mid, "runs_tok_s": [round(r["output_throughput"], 1) for r in runs]}


def _run_levels(spec: dict, vocab: int, title: str, pid: int, profile_delay: float, run) -> tuple[dict, dict]:
    """``run(reqs, concurrency) -> (results, seconds)`` at every level (``spec["repeats"]``
    times, the median kept: ``median_run``), then (with ``spec["profile"]``) once more under
    py-spy on ``pid``. Returns (levels, profile)."""
    levels, prof = {}, None
    for c in spec["levels"]:
        reqs = make_workload(_level_prompts(spec, c), spec["input_len"], spec["output_len"], vocab, spec["seed"])
        runs = []
        for _ in range(_repeats(spec)):
            res, dur = run(reqs, c)
            runs.append(summarize(res, dur))
        levels[str(c)] = median_run(runs)
        print_summary(f"{title} c={c}", levels[str(c)])
    c = spec.get("profile")
    if c:
        tok_s = levels.get(str(c), {}).get("output_throughput", 10000.0)
        reqs = make_workload(_profile_prompts(spec, tok_s), spec["input_len"], spec["output_len"], vocab,
                             spec["seed"] + 7)
        p = _Profiler(pid, spec["py_spy"], spec["profile_seconds"], delay=profile_delay)
        res, dur = run(reqs, c)
        prof = {"concurrency": c, "run": summarize(res, dur), "py_spy": p.join()}
    return levels, prof


def child_asyncllm(spec: dict) -> dict:
    from pyengine import AsyncLLM, EngineArgs

    engine = AsyncLLM.from_engine_args(EngineArgs(**_engine_kwargs(spec)))
    vocab = engine.config.hf_config.vocab_size
    levels, prof = {}, None
    try:
        run_in_process(engine, make_workload(8, spec["input_len"], 8, vocab, spec["seed"] + 99), 8,
                       math.inf, 0)  # warm-up
        levels, prof = _run_levels(spec, vocab, f"asyncllm/{spec['core']}", os.getpid(), 1.0,
                                   lambda reqs, c: run_in_process(engine, reqs, c, math.inf, spec["seed"]))
    finally:
        engine.shutdown()
    return {"levels": levels, "profile": prof}


def _engine_flags(kw: dict) -> list[str]:
    """``vengine serve`` flags for the engine arguments ``kw`` (the model is positional):
    one ``--field-name`` per field, ``--no-field-name`` for a False flag."""
    args = [kw["model"]]
    for name, value in kw.items():
        flag = name.replace("_", "-")  # (pyengine.arg_utils.flag_name's rule; not imported: no torch here)
        if name == "model":
            continue
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            args += [f"--{flag}", str(value)]
    return args


def _serve_args(spec: dict) -> list[str]:
    """``vengine serve``'s arguments for the run: the engine's, then the server's."""
    return [*_engine_flags(_engine_kwargs(spec)), "--port", "0",
            *([] if spec.get("api_server_count") == "auto" else
              ["--api-server-count", str(spec.get("api_server_count", 1))]),
            "--disable-access-log", "--log-level", "warning"]


def _serve_cmd(spec: dict) -> list[str]:
    args = _serve_args(spec)
    pre = f"import sys; sys.setswitchinterval({spec['switch_interval'] / 1000.0!r}); " if spec.get(
        "switch_interval") else "import sys; "
    return [sys.executable, "-c", pre + f"sys.argv = ['vengine'] + {args!r}; from server.cli import main; "
                                        "sys.exit(main())"]


def start_server_subprocess(cmd: list[str], env: dict | None = None, timeout: float = 300.0):
    env = dict(env or os.environ)
    env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout
    lines = []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(lines[-30:]))
            continue
        lines.append(line)
        m = re.search(r"serving .* on (http://\S+)", line)
        if m:
            # keep draining its output so a chatty server never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("server did not start:\n" + "".join(lines[-30:]))


def _http_level(url: str, spec: dict, reqs: list[Req], c: int) -> tuple[list[Result], float]:
    """The requests spread over client processes that start together."""
    k = max(1, min(spec["http_clients"], c))
    start_at = time.time() + 3.0
    procs = []
    for i in range(k):
        shard = reqs[i::k]
        conc = c // k + (1 if i < c % k else 0)
        payload = json.dumps({"url": url, "reqs": [asdict(r) for r in shard], "concurrency": conc,
                              "start_at": start_at, "seed": spec["seed"], "client": spec.get("client", "own")})
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--http-client"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=_REPO)
        p.stdin.write(payload)
        p.stdin.close()
        procs.append(p)
    results = []
    for p in procs:
        out = p.stdout.read()
        p.wait()
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"HTTP client failed: {out[-500:]}")
        results += [Result(**r) for r in json.loads(line[7:])]
    ok = [r for r in results if r.ok] or results
    return results, max(r.end for r in ok) - min(r.start for r in ok if r.start)


def http_client_main() -> int:
    job = json.loads(sys.stdin.read())
    reqs = [Req(**r) for r in job["reqs"]]
    run = HTTP_CLIENTS[job.get("client", "own")]
    res, _ = run(job["url"], reqs, None, "/v1/completions", job["concurrency"], math.inf, job["seed"], None,
                 start_at=job["start_at"])
    print("RESULT " + json.dumps([asdict(r) for r in res]), flush=True)
    return 0


def child_http(spec: dict) -> dict:
    proc, url = start_server_subprocess(_serve_cmd(spec))
    vocab = _vocab(spec["model"])
    levels, prof = {}, None
    try:
        _http_level(url, spec, make_workload(8, spec["input_len"], 8, vocab, spec["seed"] + 99), 8)  # warm-up
        levels, prof = _run_levels(spec, vocab, f"http/{spec['core']}", proc.pid, 4.0,
                                   lambda reqs, c: _http_level(url, spec, reqs, c))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"levels": levels, "profile": prof}


C_DRIVER = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "vllm.h"

/* argv: model max_num_seqs max_model_len device max_tokens prompts_file times_prefix C:N [C:N ...]
 * (max_num_seqs, max_model_len, device: vllm_model_params fields, 0 for the default)
 * prompts_file: NUL-separated prompts. One engine for every level: at each level C:N,
 * submits the first N prompts with at most C in flight and writes to times_prefix.I (I: the entry's index),
 * per request, the submit time then every callback's time (doubles, seconds), the list
 * preceded by its length as a double; prints one JSON line per level. */
typedef struct { double* t; int n, cap; } rec;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int inflight = 0;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static bool cb(const char* d, bool fin, void* ud) {
  rec* r = ud; (void)d;
  if (r->n < r->cap) r->t[r->n++] = now();
  if (fin) { pthread_mutex_lock(&mu); inflight--; pthread_cond_signal(&cv); pthread_mutex_unlock(&mu); }
  return true;
}

static int run_level(vllm_engine* e, const vllm_sampling_params* sp, char** prompts, int n, int conc,
                     int max_tokens, const char* path) {
  rec* recs = calloc(n, sizeof(rec)); double* t_submit = calloc(n, sizeof(double));
  vllm_request** rs = calloc(n, sizeof(*rs));
  int failed = 0;
  double t0 = now();
  for (int i = 0; i < n; i++) {
    recs[i].cap = max_tokens + 8; recs[i].t = malloc(sizeof(double) * recs[i].cap);
    pthread_mutex_lock(&mu);
    while (inflight >= conc) pthread_cond_wait(&cv, &mu);
    inflight++;
    pthread_mutex_unlock(&mu);
    t_submit[i] = now();
    if (vllm_request_submit(e, prompts[i], sp, cb, &recs[i], &rs[i]) != VLLM_OK) {
      fprintf(stderr, "submit: %s\n", vllm_last_error()); return -1; }
  }
  for (int i = 0; i < n; i++) { failed += vllm_request_wait(rs[i]) != VLLM_OK; vllm_request_free(rs[i]); }
  double dt = now() - t0;
  FILE* o = fopen(path, "wb");
  for (int i = 0; i < n; i++) { double k = recs[i].n; fwrite(&t_submit[i], 8, 1, o); fwrite(&k, 8, 1, o);
    fwrite(recs[i].t, 8, recs[i].n, o); free(recs[i].t); }
  fclose(o);
  printf("{\"concurrency\": %d, \"seconds\": %.6f, \"requests\": %d, \"failed\": %d}\n", conc, dt, n, failed);
  fflush(stdout);
  free(recs); free(t_submit); free(rs);
  return failed;
}

int main(int argc, char** argv) {
  if (argc < 9) { fprintf(stderr, "usage\n"); return 2; }
  int max_tokens = atoi(argv[5]);
  FILE* f = fopen(argv[6], "rb"); fseek(f, 0, SEEK_END); long sz = ftell(f); fseek(f, 0, SEEK_SET);
  char* blob = malloc(sz + 1); if (fread(blob, 1, sz, f) != (size_t)sz) return 2; fclose(f); blob[sz] = 0;
  int n = 0; for (long i = 0; i < sz; i++) n += blob[i] == 0;
  char** prompts = malloc(sizeof(char*) * n);
  { long p = 0; for (int i = 0; i < n; i++) { prompts[i] = blob + p; p += strlen(blob + p) + 1; } }
  vllm_model_params mp = vllm_model_params_default();
  mp.model_path = argv[1]; mp.max_num_seqs = atoi(argv[2]); mp.max_model_len = atoi(argv[3]);
  mp.device = atoi(argv[4]);
  vllm_engine* e = NULL;
  if (vllm_engine_load(&mp, &e) != VLLM_OK) { fprintf(stderr, "load: %s\n", vllm_last_error()); return 1; }
  vllm_sampling_params sp = vllm_sampling_params_default();
  sp.temperature = 0; sp.max_tokens = max_tokens; sp.ignore_eos = 1;
  { vllm_completion c; vllm_sampling_params w = sp; w.max_tokens = 8;
    for (int i = 0; i < 2; i++) { vllm_complete(e, prompts[i % n], &w, &c); vllm_completion_free(&c); } }
  int failed = 0;
  for (int a = 8; a < argc; a++) {
    int conc = atoi(argv[a]), k = atoi(strchr(argv[a], ':') + 1);
    char path[4096]; snprintf(path, sizeof path, "%s.%d", argv[7], a - 8);
    int r = run_level(e, &sp, prompts, k < n ? k : n, conc, max_tokens, path);
    if (r < 0) return 1;
    failed += r;
  }
  vllm_engine_free(e);
  return failed != 0;
}
"""


def _capi_results(path: Path, n: int, prompt_len: int, output_len: int) -> list[Result]:
    import array
    a = array.array("d")
    a.frombytes(path.read_bytes())
    out, i = [], 0
    for _ in range(n):
        t_sub, k = a[i], int(a[i + 1])
        ts = a[i + 2:i + 2 + k]
        i += 2 + k
        r = Result(True, prompt_len, output_tokens=output_len, events=max(k - 1, 0))
        r.start, r.end = t_sub, ts[-1] if k else t_sub
        r.ttft = (ts[0] - t_sub) if k else 0.0
        r.e2e = r.end - t_sub
        r.itls = [ts[j] - ts[j - 1] for j in range(1, k - 1)]  # the last callback is the empty final one
        out.append(r)
    return out


# vllm_model_params.device's codes (include/vllm.h)
_CAPI_DEVICES = {"auto": 0, "cpu": 1, "cuda": 2}


def capi_engine_params(spec: dict) -> tuple[list[str], dict[str, str], dict]:
    """The C driver's share of ``_engine_kwargs(spec)``: its argv fields (model path,
    max_num_seqs, max_model_len, device code; 0: the default), the environment that
    carries what ``vllm_model_params`` has no field for (``async_scheduling=False``:
    ``VENGINE_ASYNC_SCHED=0``), and the ``EngineArgs`` keywords the C ABI builds from
    those (capi/_impl.py's ``_engine_args``). The other arguments (dtype, seed,
    stream_interval) have no C field: ``check_capi_engine_config`` refuses a run where
    the engine's own default for them differs from the spec's."""
    kw = _engine_kwargs(spec)
    fields = {"max_num_seqs": int(kw.get("max_num_seqs") or 0), "max_model_len": int(kw.get("max_model_len") or 0),
              "device": _CAPI_DEVICES[kw.get("device", "auto")]}
    capi_kw: dict = {"model": kw["model"], "device": kw.get("device", "auto")}
    capi_kw.update({k: v for k, v in fields.items() if k != "device" and v > 0})
    env = {}
    if kw.get("async_scheduling") is False:
        env["VENGINE_ASYNC_SCHED"] = "0"
        capi_kw["async_scheduling"] = False
    argv = [kw["model"], str(fields["max_num_seqs"]), str(fields["max_model_len"]), str(fields["device"])]
    return argv, env, capi_kw


def check_capi_engine_config(spec: dict) -> None:
    """ValueError unless the C host's engine gets the same resolved engine config as the
    other front ends of the run (every ``EngineConfig`` field; an argument the C ABI
    cannot carry, such as a dtype other than the checkpoint's, is named)."""
    from pyengine import EngineArgs

    want = vars(EngineArgs(**_engine_kwargs(spec)).create_engine_config())
    got = vars(EngineArgs(**capi_engine_params(spec)[2]).create_engine_config())
    differ = sorted(k for k in want if got.get(k) != want[k])
    if differ:
        raise ValueError("the C ABI front end would run another engine config than the others: "
                         + ", ".join(f"{k}={got.get(k)!r} (others: {want[k]!r})" for k in differ)
                         + "; vllm_model_params has no field for these (give the run values it can match)")


def child_capi(spec: dict) -> dict:
    from transformers import AutoTokenizer

    from capi.build import build

    check_capi_engine_config(spec)
    engine_argv, engine_env, _ = capi_engine_params(spec)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    vocab = _vocab(spec["model"])
    n_max = max(_level_prompts(spec, c) for c in spec["levels"])
    reqs = make_workload(n_max, spec["input_len"], spec["output_len"], vocab, spec["seed"])
    texts = [tok.decode(r.prompt).replace("\0", " ") or "x" for r in reqs]
    levels = {}
    with tempfile.TemporaryDirectory(prefix="serve-capi-") as tmp:
        tmp = Path(tmp)
        lib = build(tmp / "lib")
        (tmp / "driver.c").write_text(C_DRIVER)
        exe = tmp / "driver"
        subprocess.run(["gcc", "-O2", "-std=c11", "-pthread", f"-I{Path(_REPO) / 'include'}", str(tmp / "driver.c"),
                        "-o", str(exe), f"-L{lib.parent}", "-lvengine", f"-Wl,-rpath,{lib.parent}"], check=True)
        (tmp / "prompts").write_bytes(b"".join(t.encode() + b"\0" for t in texts))
        env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **engine_env)
        plan = [f"{c}:{_level_prompts(spec, c)}" for c in spec["levels"] for _ in range(_repeats(spec))]
        proc = subprocess.run([str(exe), *engine_argv, str(spec["output_len"]),
                               str(tmp / "prompts"), str(tmp / "times"), *plan], capture_output=True, text=True,
                              env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"C driver failed: {proc.stderr[-2000:]}")
        runs: dict[str, list[dict]] = {}
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        for i, info in enumerate(lines):  # one line per plan entry, in order: times.<entry>
            res = _capi_results(tmp / f"times.{i}", info["requests"], spec["input_len"], spec["output_len"])
            runs.setdefault(str(info["concurrency"]), []).append(summarize(res, info["seconds"]))
        for c, rs in runs.items():
            levels[c] = median_run(rs)
            print_summary(f"capi/{spec['core']} c={c}", levels[c])
    return {"levels": levels}


CHILDREN = {"offline": child_offline, "asyncllm": child_asyncllm, "http": child_http, "capi": child_capi}


def child_main(name: str) -> int:
    spec = json.loads(sys.stdin.read())
    if name.startswith("http-aio"):  # http-aio[-xN]: the aiohttp client (vllm bench serve's shape)
        spec["client"] = "aiohttp"
        name = "http" + name[len("http-aio"):].replace("-x", "-x", 1)
    if name == "http-auto":  # vengine serve's own --api-server-count (auto_api_server_count)
        spec["api_server_count"] = "auto"
        name = "http"
    if name.startswith("http-x"):  # http-xN: --api-server-count N
        spec["api_server_count"] = int(name[len("http-x"):])
        name = "http"
    if spec["core"] == "mp":
        os.environ[CORE_ENV] = "1"
    elif spec["core"] == "inproc":
        os.environ[CORE_ENV] = "0"
    if spec.get("switch_interval"):
        sys.setswitchinterval(spec["switch_interval"] / 1000.0)
    t0 = time.time()
    try:
        out = CHILDREN[name](spec)
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported in the suite's table
        import traceback
        traceback.print_exc()
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    out["wall_s"] = time.time() - t0
    print("RESULT " + json.dumps(out, default=str), flush=True)
    return 0


def _run_child(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    env[CORE_ENV] = "1" if spec["core"] == "mp" else "0"
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", spec["frontend"]],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=_REPO, env=env)
    p.stdin.write(json.dumps(spec))
    p.stdin.close()
    result, tail = None, []
    deadline = time.time() + timeout
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    try:
        for line in p.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
            else:
                tail = (tail + [line])[-40:]
                sys.stdout.write(f"  [{spec['frontend']}/{spec['core']}] {line}")
                sys.stdout.flush()
        p.wait()
    finally:
        timer.cancel()
    if result is None:
        why = "timed out" if time.time() >= deadline else f"exit {p.returncode}"
        result = {"ok": False, "error": f"child {why}: " + "".join(tail[-12:])}
    return result


def ensure_weights(model_dir: Path, device: str, dtype: str, seed: int) -> None:
    """Random weights in safetensors next to the shape's config (once), so every front
    end, the C ABI included, loads the same model from disk."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    marker = model_dir / ".vengine_weights"
    if marker.is_file() and any(model_dir.glob("*.safetensors")):
        return
    cfg = AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(seed)
    dt = getattr(torch, dtype)
    with torch.device(device if device == "cuda" else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    cfg.save_pretrained(str(model_dir))
    del model
    marker.write_text("random")


def _ratio_table(results: dict, levels: list[int]) -> tuple[list, list]:
    """Each level's rate × the ``LLM.generate`` ceiling, and (second figure) × the
    closed-loop offline rate at the same concurrency."""
    rows, headers = [], ["front end", "core"] + [f"c={c} tok/s (× offline, × offline at c={c})" for c in levels] + \
        [f"TTFT p50 c={levels[-1]} (ms)", f"TPOT p50 c={levels[-1]} (ms)", f"ITL p50 c={levels[-1]} (ms)"]
    for core, by_fe in results.items():
        off = by_fe.get("offline", {})
        off_levels = off.get("levels", {}) if off.get("ok") else {}
        ceiling = off_levels.get("all", {}).get("output_throughput")
        for fe, r in by_fe.items():
            if fe == "offline":
                blank = [""] * (len(levels) + 3)
                rows.append(["offline LLM.generate (all at once)", core] + blank[:len(levels) - 1] +
                            [f"{ceiling:,.0f} (ceiling)" if ceiling else "failed"] + blank[:3])
                closed = [off_levels.get(str(c), {}).get("output_throughput") for c in levels]
                if any(closed):
                    rows.append(["offline, closed loop at c", core] + [f"{x:,.0f}" if x else "" for x in closed] + blank[:3])
                continue
            if not r.get("ok"):
                rows.append([fe, core, "failed: " + r.get("error", "")[:60]] + [""] * (len(levels) + 2))
                continue
            cells = []
            for c in levels:
                tps = r["levels"].get(str(c), {}).get("output_throughput", float("nan"))
                fair = off_levels.get(str(c), {}).get("output_throughput")
                cell = f"{tps:,.0f}" + (f" ({tps / ceiling:.2f}×" if ceiling else " (") + \
                    (f", {tps / fair:.2f}×)" if fair else ")")
                cells.append(cell.replace(" ()", ""))
            last = r["levels"].get(str(levels[-1]), {})
            rows.append([fe, core] + cells + [f"{last.get('p50_ttft_ms', float('nan')):.1f}",
                                              f"{last.get('p50_tpot_ms', float('nan')):.2f}",
                                              f"{last.get('p50_itl_ms', float('nan')):.2f}"])
    return headers, rows


def suite(a) -> dict:
    from benchmarks.common import hardware_info, make_model_dir, md_table

    if a.model:
        model_dir = Path(a.model)
    else:
        from benchmarks.common import default_model_dir
        model_dir = make_model_dir(a.shape, Path(a.model_dir) if a.model_dir else default_model_dir(a.shape))
        ensure_weights(model_dir, a.device, a.dtype or ("bfloat16" if a.device == "cuda" else "float32"), a.seed)
    hw = hardware_info(a.device)
    levels = [int(x) for x in a.concurrency.split(",")]
    results: dict = {}
    payload = {"benchmark": "serve_suite", "command": " ".join(sys.argv), "hardware": hw, "args": vars(a),
               "results": results}
    for core in a.cores.split(","):
        for fe in a.frontends.split(","):
            spec = _child_spec(a, fe, core, str(model_dir))
            if fe not in ("offline", "asyncllm", "http"):  # the profiled front ends
                spec["profile"] = None
            print(f"=== {fe} / core={core}", flush=True)
            results.setdefault(core, {})[fe] = _run_child(spec, a.child_timeout)
            _write_json(a.json_out, payload)  # after every child: a run cut short keeps what it did
    headers, rows = _ratio_table(results, levels)
    payload["table"] = md_table(headers, rows)
    print("\n" + payload["table"])
    _write_json(a.json_out, payload)
    return payload


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


# ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", action="store_true", help="every front end against the offline ceiling.")
    p.add_argument("--frontends", default=",".join(FRONTENDS))
    p.add_argument("--cores", default="inproc,mp", help="engine cores to run the front ends on (inproc, mp).")
    p.add_argument("--shape", default="qwen3-0.6b", help="model shape (random weights) when --model is not given.")
    p.add_argument("--model-dir", default=None, help="where the shape's config, tokenizer and weights go.")
    p.add_argument("--model", default=None, help="suite: a model directory; HTTP client mode: the model name.")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--c1-prompts", type=int, default=16, help="requests at concurrency 1")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http-clients", type=int, default=8, help="client processes for the HTTP front end")
    p.add_argument("--profile", type=int, default=None, metavar="C",
                   help="also profile offline, asyncllm and http at concurrency C with py-spy")
    p.add_argument("--profile-seconds", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=1,
                   help="run each level this many times on one engine and keep the median (every run's tok/s is kept too)")
    p.add_argument("--py-spy", default=None, help="py-spy executable (default: on PATH or next to python)")
    p.add_argument("--switch-interval", type=float, default=None, help="ms; sys.setswitchinterval in the front end")
    p.add_argument("--stream-interval", type=int, default=None, help="engine arg stream_interval")
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--child-timeout", type=float, default=900.0)
    p.add_argument("--json", dest="json_out", default=None)
    # plain client of a running server
    p.add_argument("--base-url", default=None, help="benchmark a running server (HTTP client mode)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    p.add_argument("--vocab-size", type=int, default=256, help="HTTP client mode: token-id range of prompts")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf: all at once.")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--client", default="own", choices=sorted(HTTP_CLIENTS),
                   help="HTTP client mode: own (gevent, raw sockets, one connection per request) or aiohttp "
                        "(pooled keep-alive connections, as vllm bench serve)")
    # internal
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--http-client", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.child:
        return child_main(a.child)
    if a.http_client:
        return http_client_main()
    if a.suite:
        suite(a)
        return 0
    if not a.base_url:
        raise SystemExit("give --suite, or --base-url of a running server")
    reqs = make_workload(a.num_prompts, a.input_len, a.output_len, a.vocab_size, a.seed)
    res, dur = HTTP_CLIENTS[a.client](a.base_url, reqs, a.model, a.endpoint, a.max_concurrency, a.request_rate,
                                      a.seed, a.api_key)
    out = summarize(res, dur)
    print_summary(f"HTTP {a.endpoint}", out)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
