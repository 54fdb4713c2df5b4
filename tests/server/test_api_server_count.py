"""``vengine serve --api-server-count 2``: two API server processes over one engine
process serve the same greedy completions as one; the port answers 503 while they start;
SIGTERM stops every process; a dead engine process stops the server with a non-zero
status."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import hf_greedy, live_children, process_gone, prompt_token_ids
from tests.server.http_util import get, post

REPO = Path(__file__).resolve().parents[2]


def _engine_text(tokenizer, prompt, ids) -> str:
    """The text the engine gives for greedy ``ids`` after ``prompt`` (its detokenizer)."""
    from pyengine import SamplingParams
    from pyengine.engine.detokenizer import make_incremental_detokenizer

    d = make_incremental_detokenizer(tokenizer, prompt, SamplingParams())
    d.update(ids, stop_terminated=False, finished=True)
    return d.get_next_output_text(finished=True, delta=False)


def _start(model_dir, *extra):
    """Start the supervisor and return ``(proc, port, output lines)`` once it serves. On
    its "loading" line (printed before the engine and API server processes start) its
    port must already answer 503 ``{"status": "loading"}``, and from then on ``/health``
    goes from 503 to 200 once, never back (issue 29, readiness)."""
    cmd = [sys.executable, "-m", "server", str(model_dir), "--port", "0", "--device", "cpu",
           "--api-server-count", "2", "--num-gpu-blocks-override", "512", "--max-model-len", "256",
           "--disable-access-log", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines, probes, done = [], [], threading.Event()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("vengine: loading"):
            port = int(line.split(" answers ")[0].rsplit(":", 1)[1])
            status, hdrs, body = get(port, "/health")
            assert (status, json.loads(body), hdrs["Retry-After"]) == (503, {"status": "loading"}, "5"), body
            threading.Thread(target=_probe_health, args=(port, probes, done), daemon=True).start()
        if "vengine: serving" in line:
            done.set()
            changes = [s for i, s in enumerate(probes) if i == 0 or probes[i - 1] != s]
            assert changes in ([503], [503, 200]), changes
            return proc, int(line.rsplit(":", 1)[1].split()[0].strip("/")), lines
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines[-40:]))


def _probe_health(port: int, out: list, done: threading.Event) -> None:
    """``GET /health`` on a fresh connection every 10 ms until ``done``: the statuses, or
    what went wrong instead ("reset": the connection was reset, e.g. by a server that
    stopped without answering; another error's class name), so that ``_start``'s check
    sees it rather than a list cut short by a dead thread."""
    while not done.is_set():
        try:
            out.append(get(port, "/health")[0])
        except ConnectionResetError:  # http.client.RemoteDisconnected too: closed unanswered
            out.append("reset")
        except Exception as e:  # noqa: BLE001 - recorded, and fails the check
            out.append(type(e).__name__)
        time.sleep(0.01)


@pytest.mark.timeout(400)
def test_two_api_servers_serve_and_stop(llama_dir, tokenizer):
    proc, port, _ = _start(llama_dir)
    try:
        procs = live_children(proc.pid, recursive=True)
        assert len(procs) >= 3  # two API servers and the engine (and the forkserver)
        assert get(port, "/health")[0] == 200
        prompts = prompt_token_ids(tokenizer, 6, min_len=4, max_len=30, seed=31)
        texts = []
        for p in prompts:  # several connections: the kernel spreads them over both servers
            status, _, raw = post(port, "/v1/completions", {"prompt": p, "max_tokens": 16, "temperature": 0,
                                                            "ignore_eos": True})
            assert status == 200
            texts.append(json.loads(raw)["choices"][0]["text"])
        assert texts == [_engine_text(tokenizer, p, ids)
                         for p, ids in zip(prompts, hf_greedy(llama_dir, prompts, 16, ignore_eos=True))]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 20
        while not all(process_gone(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in procs if not process_gone(p)]
        assert not left, f"processes left behind: {left}"
    finally:
        proc.kill()


@pytest.mark.timeout(400)
def test_engine_death_stops_every_api_server(llama_dir):
    proc, port, _ = _start(llama_dir)
    try:
        engine = [p for p in live_children(proc.pid, recursive=True)
                  if "forkserver" in Path(f"/proc/{p}/cmdline").read_text() and live_children(p, recursive=True) == set()]
        assert engine, "no engine process found"
        for p in engine:
            os.kill(p, signal.SIGKILL)
        assert proc.wait(60) != 0
    finally:
        proc.kill()
