"""Serving benchmark (in the manner of ``vllm bench serve``).

Three modes:

* HTTP client (default): stream ``/v1/completions`` (or ``/v1/chat/completions``) from a
  running server at a request rate (Poisson arrivals) and/or a max concurrency, with
  random or fixed prompt/output lengths; reports TTFT, TPOT, ITL and E2E percentiles and
  request/token throughput::

      python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 \\
          --max-concurrency 16 --input-len 128 --output-len 64

* ``--in-process --model DIR``: the same workload straight through ``AsyncLLM``
  (asyncio ``generate``), no HTTP.

* ``--compare --model DIR --concurrency 1,16,64``: for each concurrency, the workload
  in-process, then over HTTP against ``vengine serve`` started as a subprocess on a free
  port; prints the HTTP/in-process output-throughput ratio table.

The HTTP client is gevent greenlets on raw sockets (no monkey-patching, no extra
dependency), so hundreds of streams cost the client little.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlparse

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

# ----------------------------------------------------------------------------------------
# Workload


@dataclass
class Req:
    prompt: list[int]
    output_len: int


def make_workload(num: int, input_len: int, output_len: int, dataset: str, range_ratio: float,
                  vocab_size: int, seed: int, skip_ids: int = 8) -> list[Req]:
    """Token-id prompts (exact lengths, no tokenizer round trip). ``dataset="random"``
    draws lengths uniformly in ``[L*(1-r), L*(1+r)]``; ``"fixed"`` uses ``L`` exactly."""
    rng = random.Random(seed)
    lo_id, hi_id = skip_ids, max(skip_ids + 1, vocab_size - 1)
    out = []
    for _ in range(num):
        if dataset == "random" and range_ratio > 0:
            il = rng.randint(max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio))))
            ol = rng.randint(max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio))))
        else:
            il, ol = input_len, output_len
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
    s = {"completed": len(good), "failed": len(results) - len(good), "duration_s": duration,
         "input_tokens": in_tok, "output_tokens": out_tok,
         "request_throughput": len(good) / duration if duration else 0.0,
         "output_throughput": out_tok / duration if duration else 0.0,
         "total_token_throughput": (in_tok + out_tok) / duration if duration else 0.0}
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
    print(f"Successful requests:            {s['completed']}")
    print(f"Failed requests:                {s['failed']}")
    print(f"Benchmark duration (s):         {s['duration_s']:.2f}")
    print(f"Total input tokens:             {s['input_tokens']}")
    print(f"Total generated tokens:         {s['output_tokens']}")
    print(f"Request throughput (req/s):     {s['request_throughput']:.2f}")
    print(f"Output token throughput (tok/s):{s['output_throughput']:.2f}")
    print(f"Total token throughput (tok/s): {s['total_token_throughput']:.2f}")
    for name, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        ps = "  ".join(f"p{k[1:].split('_')[0]}={v:.2f}" for k, v in s.items()
                       if k.startswith("p") and k.endswith(name))
        print(f"{label:5s} (ms): mean={s[f'mean_{name}']:.2f}  {ps}")
    for e in s.get("errors", []):
        print(f"error: {e}")


def _arrival_gaps(n: int, rate: float, seed: int):
    rng = random.Random(seed + 1)
    for _ in range(n):
        yield 0.0 if math.isinf(rate) else rng.expovariate(rate)


# ----------------------------------------------------------------------------------------
# HTTP client (gevent, raw sockets)


def _http_stream(host: str, port: int, path: str, body: bytes, headers: dict, res: Result,
                 t_send: float) -> None:
    from gevent import socket as gsocket

    sock = gsocket.create_connection((host, port))
    try:
        sock.setsockopt(gsocket.IPPROTO_TCP, gsocket.TCP_NODELAY, 1)
        hdr = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n{hdr}\r\n").encode() + body)
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = sock.recv(65536)
            if not d:
                raise ConnectionError("connection closed before the response headers")
            buf += d
        head, buf = buf.split(b"\r\n\r\n", 1)
        status = int(head.split(b" ", 2)[1])
        chunked = b"transfer-encoding: chunked" in head.lower()
        # De-chunk incrementally, then split SSE events on blank lines.
        body_buf, events_buf, last_t, eof = buf, b"", None, False
        while True:
            if chunked:
                while True:
                    i = body_buf.find(b"\r\n")
                    if i < 0:
                        break
                    size = int(body_buf[:i].split(b";")[0], 16)
                    if len(body_buf) < i + 2 + size + 2:
                        break
                    if size == 0:
                        eof = True
                        body_buf = b""
                        break
                    events_buf += body_buf[i + 2:i + 2 + size]
                    body_buf = body_buf[i + 2 + size + 2:]
            else:
                events_buf += body_buf
                body_buf = b""
            now = time.perf_counter()
            while b"\n\n" in events_buf:
                ev, events_buf = events_buf.split(b"\n\n", 1)
                if status != 200:
                    continue
                if not ev.startswith(b"data: "):
                    continue
                data = ev[6:]
                if data == b"[DONE]":
                    eof = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"stream error: {obj['error'].get('message')}")
                if obj.get("usage") and not obj.get("choices"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
                    continue
                ch = obj["choices"][0]
                text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                if text:
                    if last_t is None:
                        res.ttft = now - t_send
                    else:
                        res.itls.append(now - last_t)
                    last_t = now
            if eof:
                break
            d = sock.recv(65536)
            if not d:
                break
            body_buf += d
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(body_buf + events_buf)[:200]!r}")
        res.e2e = time.perf_counter() - t_send
        res.ok = True
    finally:
        sock.close()


def run_http(base_url: str, reqs: list[Req], model: Optional[str], endpoint: str, max_concurrency: Optional[int],
             request_rate: float, seed: int, api_key: Optional[str], ignore_eos: bool = True) -> tuple[list, float]:
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
        res = results[i]
        try:
            _http_stream(host, port, endpoint, json.dumps(payload).encode(), headers, res, time.perf_counter())
        except Exception as e:  # noqa: BLE001 - counted as a failed request
            res.ok, res.error = False, f"{type(e).__name__}: {e}"

    pool = Pool(max_concurrency or len(reqs) or 1)
    t0 = time.perf_counter()
    for i, (r, gap) in enumerate(zip(reqs, _arrival_gaps(len(reqs), request_rate, seed))):
        if gap:
            gevent.sleep(gap)
        pool.spawn(one, i, r)
    pool.join()
    return results, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------
# In-process client (AsyncLLM, asyncio)


def run_in_process(engine, reqs: list[Req], max_concurrency: Optional[int], request_rate: float, seed: int,
                   ignore_eos: bool = True) -> tuple[list, float]:
    import asyncio
    import uuid

    from pyengine import SamplingParams
    from pyengine.sampling_params import RequestOutputKind

    results = [Result(False, len(r.prompt)) for r in reqs]

    async def one(i: int, r: Req, sem):
        async with sem:
            res = results[i]
            sp = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=ignore_eos,
                                output_kind=RequestOutputKind.DELTA)
            t_send = time.perf_counter()
            last = None
            try:
                async for out in engine.generate(r.prompt, sp, f"bench-{uuid.uuid4().hex}"):
                    now = time.perf_counter()
                    o = out.outputs[0]
                    res.output_tokens += len(o.token_ids)
                    if o.token_ids:
                        if last is None:
                            res.ttft = now - t_send
                        else:
                            res.itls.append(now - last)
                        last = now
                res.e2e = time.perf_counter() - t_send
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
# Compare mode


def _engine_kwargs(a) -> dict:
    kw = {"model": a.model, "device": a.device, "max_num_seqs": a.max_num_seqs}
    if a.max_model_len:
        kw["max_model_len"] = a.max_model_len
    if a.num_gpu_blocks_override:
        kw["num_gpu_blocks_override"] = a.num_gpu_blocks_override
    if a.no_async_scheduling:
        kw["async_scheduling"] = False
    return kw


def _serve_cmd(a) -> list[str]:
    cmd = [sys.executable, "-m", "server", a.model, "--port", "0", "--device", a.device,
           "--max-num-seqs", str(a.max_num_seqs), "--disable-access-log", "--log-level", "warning"]
    if a.max_model_len:
        cmd += ["--max-model-len", str(a.max_model_len)]
    if a.num_gpu_blocks_override:
        cmd += ["--num-gpu-blocks-override", str(a.num_gpu_blocks_override)]
    if a.no_async_scheduling:
        cmd += ["--no-async-scheduling"]
    return cmd


def start_server_subprocess(cmd: list[str], timeout: float = 180.0):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("server did not start:\n" + "".join(lines[-30:]))


def compare(a) -> dict:
    from pyengine import AsyncLLM, EngineArgs

    levels = [int(x) for x in a.concurrency.split(",")]
    table = {}
    engine = AsyncLLM.from_engine_args(EngineArgs(**_engine_kwargs(a)))
    vocab = engine.config.hf_config.vocab_size
    try:
        for c in levels:
            n = max(a.num_prompts, c * a.prompts_per_level)
            reqs = make_workload(n, a.input_len, a.output_len, a.dataset, a.range_ratio, vocab, a.seed)
            run_in_process(engine, reqs[: min(n, c * 2)], c, math.inf, a.seed)  # warm-up
            res, dur = run_in_process(engine, reqs, c, math.inf, a.seed)
            s = summarize(res, dur)
            print_summary(f"in-process AsyncLLM, concurrency {c}", s)
            table[c] = {"in_process": s}
    finally:
        engine.shutdown()
    proc, url = start_server_subprocess(_serve_cmd(a))
    try:
        for c in levels:
            n = max(a.num_prompts, c * a.prompts_per_level)
            reqs = make_workload(n, a.input_len, a.output_len, a.dataset, a.range_ratio, vocab, a.seed)
            run_http(url, reqs[: min(n, c * 2)], None, a.endpoint, c, math.inf, a.seed, None)  # warm-up
            res, dur = run_http(url, reqs, None, a.endpoint, c, math.inf, a.seed, None)
            s = summarize(res, dur)
            print_summary(f"HTTP {a.endpoint}, concurrency {c}", s)
            table[c]["http"] = s
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    print("\n| concurrency | in-process tok/s | HTTP tok/s | HTTP / in-process | in-proc p50 ITL ms | HTTP p50 ITL ms | in-proc p50 TTFT ms | HTTP p50 TTFT ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in levels:
        ip, h = table[c]["in_process"], table[c]["http"]
        ratio = h["output_throughput"] / ip["output_throughput"] if ip["output_throughput"] else float("nan")
        table[c]["ratio"] = ratio
        print(f"| {c} | {ip['output_throughput']:.1f} | {h['output_throughput']:.1f} | {ratio:.3f} | "
              f"{ip['p50_itl_ms']:.2f} | {h['p50_itl_ms']:.2f} | {ip['p50_ttft_ms']:.2f} | {h['p50_ttft_ms']:.2f} |")
    return table


# ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="HTTP: model name to send; in-process/compare: model directory.")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--dataset", choices=["random", "fixed"], default="random")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="random dataset: lengths vary by +-ratio.")
    p.add_argument("--vocab-size", type=int, default=None, help="HTTP mode: token-id range for random prompts.")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf: all at once.")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--result-json", default=None, help="write the summary (or compare table) here.")
    p.add_argument("--in-process", action="store_true", help="run through AsyncLLM in this process.")
    p.add_argument("--compare", action="store_true", help="in-process vs HTTP at --concurrency levels.")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--prompts-per-level", type=int, default=4, help="compare: at least this many x concurrency.")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--no-async-scheduling", action="store_true")
    return p


def _vocab_from_server(base_url: str, api_key: Optional[str]) -> int:
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    json.loads(urllib.request.urlopen(req, timeout=10).read())  # reachability check
    return 256  # safe for any model; pass --vocab-size for a wider id range


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    pcts = tuple(int(x) for x in a.percentiles.split(","))
    if a.compare:
        if not a.model:
            raise SystemExit("--compare needs --model DIR")
        out = compare(a)
    elif a.in_process:
        from pyengine import AsyncLLM, EngineArgs

        engine = AsyncLLM.from_engine_args(EngineArgs(**_engine_kwargs(a)))
        try:
            reqs = make_workload(a.num_prompts, a.input_len, a.output_len, a.dataset, a.range_ratio,
                                 engine.config.hf_config.vocab_size, a.seed)
            res, dur = run_in_process(engine, reqs, a.max_concurrency, a.request_rate, a.seed)
        finally:
            engine.shutdown()
        out = summarize(res, dur, pcts)
        print_summary("in-process AsyncLLM", out)
    else:
        vocab = a.vocab_size or _vocab_from_server(a.base_url, a.api_key)
        reqs = make_workload(a.num_prompts, a.input_len, a.output_len, a.dataset, a.range_ratio, vocab, a.seed)
        res, dur = run_http(a.base_url, reqs, a.model, a.endpoint, a.max_concurrency, a.request_rate, a.seed,
                            a.api_key)
        out = summarize(res, dur, pcts)
        print_summary(f"HTTP {a.endpoint}", out)
    if a.result_json:
        with open(a.result_json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
