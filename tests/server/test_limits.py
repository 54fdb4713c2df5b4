"""Context-length defaults over HTTP (issue 17 kind 4) and priority at the seat cap (kind 1),
each on its own engine: ``--max-model-len 256``; ``--max-num-seqs 2 --scheduling-policy
priority``. Huge prompts (issue 16 kind 2): refused by the cheap character bound, or
tokenized off the hub, while another stream keeps its pace."""
from __future__ import annotations

import json
import statistics
import threading
import time
from types import SimpleNamespace

import pytest

from tests.server.http_util import SSEStream, post

NAME = "tiny-llama"


def _serve(model_dir, **engine_kw):
    from server import BackgroundServer, create_app
    from tests.server.conftest import make_engine

    engine = make_engine(model_dir, **engine_kw)
    return engine, BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=[NAME])), port=0).start()


@pytest.fixture(scope="module")
def server_256(llama_dir):
    engine, srv = _serve(llama_dir, max_model_len=256, num_gpu_blocks_override=64)
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.mark.parametrize("prompts,n", [(1025, 1), (9, 128)])
def test_prompts_times_n_over_the_stream_cap_is_400(server_256, prompts, n):
    # one request with a list of 100,000 prompts queued them all ahead of every later client
    body = {"model": NAME, "prompt": [[5]] * prompts, "n": n, "temperature": 1.0, "max_tokens": 1}
    status, _, data = post(server_256.port, "/v1/completions", body)
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == "prompt", data
    assert f"asks for {prompts * n} sequences" in err["message"] and "at most 1024" in err["message"]
    ok = {"model": NAME, "prompt": [[5]] * 8, "n": 128, "temperature": 1.0, "max_tokens": 1}  # 1024: allowed
    status, _, data = post(server_256.port, "/v1/completions", ok)
    assert status == 200, data
    assert len(json.loads(data)["choices"]) == 1024


def _chat_messages_of_length(tokenizer, n):
    """Messages whose chat-template rendering (what the server feeds) is ``n`` tokens."""
    def length(content):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False).input_ids)
    words = ""
    while length(words + " x") < n:
        words += " x"
    for tail in ("", "y", "yy", "yyy", ".", ".."):
        if length(words + tail) == n:
            return [{"role": "user", "content": words + tail}]
    raise AssertionError(f"no message renders to exactly {n} tokens")


@pytest.mark.parametrize("stream", [False, True])
def test_default_max_tokens_capped_at_the_room_left(server_256, stream):
    # Issue 17: a 255-token prompt with max_model_len 256 and no max_tokens got a 400 "you
    # requested 271 tokens (255 in the prompt, 16 in the completion)". The default is capped.
    body = {"model": NAME, "prompt": [5] * 255, "temperature": 0, "ignore_eos": True, "stream": stream}
    status, _, data = post(server_256.port, "/v1/completions", body)
    assert status == 200, data
    if not stream:
        out = json.loads(data)
        assert out["usage"] == {"prompt_tokens": 255, "completion_tokens": 1, "total_tokens": 256}
        assert out["choices"][0]["finish_reason"] == "length"


def test_default_max_tokens_below_the_room_is_16(server_256):
    status, _, data = post(server_256.port, "/v1/completions",
                           {"model": NAME, "prompt": [5] * 100, "temperature": 0, "ignore_eos": True})
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 16


def test_chat_without_max_tokens_gets_the_room_left(server_256, tokenizer):
    msgs = _chat_messages_of_length(tokenizer, 250)
    status, _, data = post(server_256.port, "/v1/chat/completions",
                           {"model": NAME, "messages": msgs, "temperature": 0, "ignore_eos": True})
    assert status == 200, data
    assert json.loads(data)["usage"] == {"prompt_tokens": 250, "completion_tokens": 6, "total_tokens": 256}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [5] * 255, "max_tokens": 16}),
    ("/v1/chat/completions", None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_explicit_max_tokens_that_does_not_fit_is_400(server_256, tokenizer, path, body, stream):
    if body is None:
        body = {"messages": _chat_messages_of_length(tokenizer, 255), "max_tokens": 16}
    status, _, data = post(server_256.port, path, dict(body, model=NAME, stream=stream))
    assert status == 400, data
    err = json.loads(data)["error"]
    assert err["param"] == "max_tokens"
    assert err["message"].startswith("This model's maximum context length is 256 tokens. However, you "
                                     "requested 271 tokens (255 in the prompt, 16 in the completion).")


def test_priority_request_preempts_at_the_seat_cap(llama_dir):
    # Issue 17: --max-num-seqs 2 --scheduling-policy priority, two running
    # {"max_tokens":1000,"priority":10,"ignore_eos":true}, then {"prompt":"urgent",
    # "max_tokens":16,"priority":0}: its first token came only after a low request
    # finished. Now it preempts one, so it is done while both low ones still stream.
    engine, srv = _serve(llama_dir, max_model_len=1024, num_gpu_blocks_override=256, max_num_seqs=2,
                         scheduling_policy="priority")
    lows = []
    try:
        for i in range(2):
            s = SSEStream(srv.port, "/v1/completions",
                          {"model": NAME, "prompt": f"low {i}", "max_tokens": 1000, "priority": 10,
                           "ignore_eos": True, "temperature": 0, "stream": True})
            assert s.read_headers() == 200
            ev = s.events()
            next(ev)  # streaming: running
            lows.append((s, ev))
        status, _, data = post(srv.port, "/v1/completions",
                               {"model": NAME, "prompt": "urgent", "max_tokens": 16, "priority": 0,
                                "ignore_eos": True, "temperature": 0}, timeout=120)
        assert status == 200, data
        assert json.loads(data)["usage"]["completion_tokens"] == 16
        stats = engine.get_stats()
        assert stats.num_preemptions >= 1
        assert stats.num_running + stats.num_waiting == 2  # both low requests still unfinished
    finally:
        for s, _ in lows:
            s.close()
        srv.stop()
        engine.shutdown()


# --- huge prompts (issue 16 kind 2): cheap bounds first, tokenization off the hub ---

STEP_DELAY_S = 0.02  # a steady token rate for the watched stream
MB4 = 4 << 20


@pytest.fixture(scope="module")
def slow_server(llama_dir):
    """An in-process engine (so its steps can be slowed) with max_model_len 512, served."""
    from server import BackgroundServer, create_app
    from tests.server.conftest import make_engine, slow_steps

    engine = make_engine(llama_dir, multiprocess=False)
    slow_steps(engine, STEP_DELAY_S)
    srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=[NAME])), port=0).start()
    yield engine, srv
    srv.stop()
    engine.shutdown()


def _gaps_around(port, action):
    """Run ``action()`` on a thread while streams run back to back; returns
    ``(action's result, gaps between two events of a stream while the action ran,
    gaps otherwise)``, in seconds."""
    box, window = {}, []

    def run():
        window.append(time.monotonic())
        try:
            box["result"] = action()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e
        window.append(time.monotonic())
    worker = threading.Thread(target=run)
    during, outside = [0.0], []
    while len(window) < 2:
        s = SSEStream(port, "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 400,
                                                "ignore_eos": True, "stream": True})
        try:
            assert s.read_headers() == 200
            last = None
            for t, _ in s.events():
                if last is not None:
                    overlaps = window and t >= window[0] and (len(window) < 2 or last <= window[1])
                    (during if overlaps else outside).append(t - last)
                last = t
                if not window and len(outside) > 20:
                    worker.start()  # once the stream is steady
                if len(window) == 2 and t > window[1] + 0.5:
                    break
        finally:
            s.close()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["result"], during, outside


def _words(n_chars: int) -> str:
    import random
    rnd = random.Random(0)
    vocab = ["def", "return", "self", "value", "import", "class", "for", "in", "range", "print", "if", "else"]
    out, size = [], 0
    while size < n_chars:
        w = rnd.choice(vocab)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def _rss_mb() -> float:
    """This process's resident memory (MiB), after glibc gave back the free memory it keeps
    in its arenas (what a request freed, kept for reuse, is not growth)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS as it is
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _post_raw(port, path, payload: bytes, timeout=120):
    t0 = time.monotonic()
    status, _, data = post(port, path, payload, timeout=timeout)
    return status, json.loads(data), time.monotonic() - t0


@pytest.mark.timeout(300)
def test_4mb_prompt_refused_at_once_without_stalling_other_streams(slow_server):
    # issue 16: a 4 MB prompt was tokenized on the hub before its length was checked:
    # /health and every stream froze for 4.2 s, and RSS grew and stayed
    engine, srv = slow_server
    text = _words(MB4)
    bodies = [("/v1/completions", "prompt", json.dumps({"model": NAME, "prompt": text}).encode()),
              ("/v1/chat/completions", "messages",
               json.dumps({"model": NAME, "messages": [{"role": "user", "content": text}]}).encode()),
              ("/v1/completions", "prompt", json.dumps({"model": NAME, "prompt": ["hi", text[: 1 << 20]]}).encode())]

    def refuse_all():
        out = []
        for path, param, payload in bodies:
            status, body, took = _post_raw(srv.port, path, payload)
            out.append((param, status, body, took))
        return out
    # The stall: how much longer than the stream's own pace (its median gap) its longest gap
    # while the refusals ran was. A stall the server causes shows in every attempt; a
    # scheduler hiccup of this loaded 2-core box (gaps of 300 ms happen with no refusal
    # at all) rarely hits the same ~50 ms window three times.
    stalls = []
    for _ in range(3):
        results, during, outside = _gaps_around(srv.port, refuse_all)
        for param, status, body, took in results:
            assert status == 400, body
            err = body["error"]
            assert err["param"] == param and "characters" in err["message"] and "512 tokens" in err["message"], err
            assert took < 2.0, took
        stalls.append(max(during) - statistics.median(outside))
        print(f"inter-token gaps: largest {max(during) * 1e3:.0f} ms while refusing; median "
              f"{statistics.median(outside) * 1e3:.0f} ms, largest {max(outside) * 1e3:.0f} ms otherwise")
        if stalls[-1] <= 0.5:
            break
    # 0.5 s: the bug froze every stream for 4.2 s; a busy 2-core box running the suite in
    # parallel shows gaps of a few hundred ms with no refusal at all
    assert min(stalls) <= 0.5, stalls
    # no lasting memory growth: repeated refusals leave RSS where it was
    for _ in range(3):
        refuse_all()
    before = _rss_mb()
    for _ in range(4):
        refuse_all()  # 12 requests, 36 MiB of prompt text
    # A copy of each body kept would be 36 MiB; what is seen is a few 4 MiB buffers that
    # the allocator or the last requests still hold (0 to 16 MiB, in steps of one body)
    assert _rss_mb() - before < 24, (before, _rss_mb())


@pytest.mark.timeout(300)
def test_tokenization_and_templating_run_off_the_hub(slow_server, monkeypatch):
    # where the character bound cannot decide (a tokenizer without one, a long context),
    # the prompt is tokenized (and a chat rendered) on a threadpool thread: the Rust
    # tokenizer releases the GIL, and the hub keeps streaming
    engine, srv = slow_server
    monkeypatch.setattr(engine.processor, "max_prompt_chars", None)
    threads = []

    def on_thread(fn):
        def wrapped(*a, **k):
            threads.append((fn.__name__, threading.current_thread().name))
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(engine.processor, "encode", on_thread(engine.processor.encode))
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", on_thread(engine.tokenizer.apply_chat_template))
    text = _words(MB4)
    chat = json.dumps({"model": NAME, "messages": [{"role": "user", "content": text}]}).encode()
    payloads = [("/v1/completions", "prompt", json.dumps({"model": NAME, "prompt": text}).encode()),
                ("/v1/chat/completions", "messages", chat),
                ("/tokenize", None, chat)]  # no bound there: the count is the answer

    def tokenize_all():
        return [_post_raw(srv.port, path, payload, timeout=240) for path, _, payload in payloads]
    results, during, outside = _gaps_around(srv.port, tokenize_all)
    during, outside = max(during), max(outside)
    print(f"largest inter-token gap: {during * 1e3:.0f} ms while tokenizing, {outside * 1e3:.0f} ms otherwise")
    for (_path, param, _), (status, body, _) in zip(payloads, results):
        if param is None:
            assert status == 200 and body["count"] > 512 and body["max_model_len"] == 512, status
            continue
        assert status == 400, body
        assert body["error"]["param"] == param
        assert "However, your prompt has" in body["error"]["message"]  # counted in tokens this time
    assert [name for name, _ in threads].count("apply_chat_template") == 2
    names = {name for name, _ in threads}
    assert {"encode", "apply_chat_template"} <= names, threads
    assert all(thread != srv._thread.name for _, thread in threads), threads  # never the hub's thread
    # On the hub, tokenization stalled every stream for as long as it ran (issue 16: 4.2 s
    # for 4 MB). Off the hub, what is left is the tokenizer thread's share of the CPUs (on
    # this loaded 2-core box a thread hashing with the GIL released costs the stream as
    # much), so the stall is compared with the tokenization time, not with a fixed bound.
    took = min(t for _, _, t in results)
    assert during < 0.5 * took, (during, outside, took)
