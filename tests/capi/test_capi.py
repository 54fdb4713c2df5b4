"""C ABI tests: libvengine.so is built once per session (capi.build), C host programs are
compiled with gcc and run against the real engine on a tiny CPU model (conftest's
``llama_dir``). Each C case prints ``KEY value`` lines and exits non-zero on failure.

Environment knobs: VENGINE_CAPI_EXIT_REPS (default 5; the issue's 50 is recorded in
docs/capi.md), VENGINE_CAPI_FORK_REPS (default 10), VENGINE_CAPI_MANY (default 1000).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.capi.conftest import _cc

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
HEADER_DIR = ROOT / "include"

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

PROMPTS = ["def main():", "import os\nimport sys", "class Foo(object):"]
MAX_TOKENS = 8

EXPORTS = {
    "vllm_last_error", "vllm_version", "vllm_abi_version", "vllm_model_params_default",
    "vllm_sampling_params_default", "vllm_model_params_init", "vllm_sampling_params_init",
    "vllm_engine_load", "vllm_engine_free", "vllm_complete", "vllm_complete_tokens",
    "vllm_completion_free", "vllm_string_free", "vllm_complete_stream", "vllm_request_submit",
    "vllm_request_cancel", "vllm_request_wait", "vllm_request_done", "vllm_request_error",
    "vllm_request_free", "vllm_chat", "vllm_chat_stream", "vllm_engine_sampling_params_default",
}

# vllm.cpp's field order (the list), then vengine's additions.
MODEL_FIELDS = ["model_path", "tokenizer_config_path", "block_size", "num_blocks", "max_model_len",
                "max_num_seqs", "tool_parser", "reasoning_parser", "speculative_config",
                "enable_prefix_caching", "max_num_batched_tokens", "scheduling_policy",
                "kv_transfer_config", "enable_jump_forward", "device", "gpu_memory_utilization",
                "kv_cache_memory_bytes", "tensor_parallel_size", "quantization", "kv_cache_dtype"]
SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "has_seed",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                   "ignore_eos", "stop", "n_stop", "structured_json", "structured_regex",
                   "structured_choice", "n_structured_choice", "structured_grammar",
                   "structured_json_object", "logits_processor", "logits_processor_user_data",
                   "priority", "bad_words", "n_bad_words", "allowed_token_ids", "n_allowed_token_ids"]


# ---------------------------------------------------------------------------
# fixtures

@pytest.fixture(scope="session")
def reference(llama_dir):
    """Greedy outputs of the Python API (AsyncLLM, as the C ABI uses) for PROMPTS and
    for the pre-tokenized prompt [1, 2, 3, 4]."""
    from pyengine import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams

    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(llama_dir), max_num_seqs=16,
                                               kv_cache_memory_bytes=16 << 20))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
        ref = {}
        for i, p in enumerate(PROMPTS + [[1, 2, 3, 4]]):
            out = llm.add_request(f"ref-{i}", p, sp).get(timeout=120)
            ref[i] = (out.outputs[0].text, list(out.outputs[0].token_ids))
        tok = llm.tokenizer
        chat = [{"role": "user", "content": "Write a haiku about tests."}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out = llm.add_request("ref-chat", ids, sp).get(timeout=120)
        ref["chat"] = (out.outputs[0].text, len(ids))
        return ref
    finally:
        llm.shutdown()


def _start(binary, lib, case, model, *args, mode="local", env=None, core="process"):
    """The C host ``binary`` running ``case``, started. ``core``: "process" (the default a
    C host gets, the engine core in a process of its own) or "thread" (the core on a thread
    of the host's interpreter, VENGINE_ENABLE_MULTIPROCESSING=0): the cases whose subject
    lies above the engine core (argument rules, chat, sampling fields, the delivery pool)
    take the thread, which saves the ~5 s of an engine-core process's start per run;
    both cores serve the same text (test_in_process_and_engine_process_cores_give_the_same_text)."""
    e = dict(os.environ)
    e.pop("VENGINE_PYTHONPATH", None)
    if core == "thread":
        e["VENGINE_ENABLE_MULTIPROCESSING"] = "0"
    if env:
        e.update(env)
    # own process group, so a hung forked child is killed with its parent
    p = subprocess.Popen([str(binary), str(lib), mode, case, str(model), *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e,
                         start_new_session=True)
    p.t0 = time.monotonic()
    return p


def _finish(p, case, timeout=180):
    try:
        out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - p.t0)))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{case} timed out after {timeout}s\n{out}\n{err[-3000:]}")
    proc = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    proc.elapsed = time.monotonic() - p.t0
    return proc


def _run(binary, lib, case, model, *args, mode="local", env=None, timeout=180, core="process"):
    return _finish(_start(binary, lib, case, model, *args, mode=mode, env=env, core=core), case, timeout)


def _check(proc):
    assert proc.returncode == 0 and "RESULT OK" in proc.stdout, \
        f"rc={proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}"
    return proc.stdout


def _escape(s: str) -> str:
    out = []
    for ch in s:
        if ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _unescape(s: str) -> str:
    return re.sub(r"\\(\\|n|x[0-9a-f]{2})",
                  lambda m: {"\\": "\\", "n": "\n"}.get(m.group(1)) or chr(int(m.group(1)[1:], 16)), s)


# ---------------------------------------------------------------------------
# header and exports

@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_header_compiles_as_c11_and_cxx17(tmp_path):
    checks = []
    for struct, fields in (("vllm_model_params", MODEL_FIELDS), ("vllm_sampling_params", SAMPLING_FIELDS)):
        for a, b in zip(fields, fields[1:]):
            checks.append(f"VG_ASSERT(offsetof({struct}, {a}) < offsetof({struct}, {b}), \"{a} before {b}\");")
    body = "\n".join(checks)
    c_src = tmp_path / "tu.c"
    c_src.write_text('#include "vllm.h"\n#include <stddef.h>\n#define VG_ASSERT _Static_assert\n'
                     f"{body}\nint vg_unused(void);\nint vg_unused(void) {{ return VLLM_ABI_VERSION; }}\n")
    cxx_src = tmp_path / "tu.cpp"
    cxx_src.write_text('#include "vllm.h"\n#include <cstddef>\n#define VG_ASSERT static_assert\n'
                       f"{body}\n"
                       "static bool cb(const char*, bool, void*) { return true; }\n"
                       "int main() { vllm_token_callback f = cb; (void)f; return VLLM_OK; }\n")
    _cc(["gcc", "-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror", f"-I{HEADER_DIR}", "-c",
         str(c_src), "-o", str(tmp_path / "tu.o")])
    _cc(["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{HEADER_DIR}", "-c", str(cxx_src),
         "-o", str(tmp_path / "tu_cpp.o")])


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
def test_exports_exactly_the_api(capi_lib):
    out = subprocess.run(["nm", "-D", "--defined-only", str(capi_lib)], capture_output=True, text=True,
                         check=True).stdout
    syms = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert syms - {"PyInit__vengine_cffi"} == EXPORTS


def test_header_declares_every_export():
    header = (HEADER_DIR / "vllm.h").read_text()
    declared = set(re.findall(r"VLLM_API [^;]*?\b(vllm_\w+)\(", header, re.S))
    assert declared == EXPORTS


# ---------------------------------------------------------------------------
# behaviour (real engine, tiny CPU model)

@pytest.mark.parametrize("mode, tp", [("local", 1), ("global", 1), ("local", 2)])
def test_complete_and_stream_match_python_api(capi_test_bin, capi_lib, llama_dir, reference, mode, tp):
    # tp=2: vllm_model_params.tensor_parallel_size; the embedded Python spawns the worker rank
    out = _check(_run(capi_test_bin, capi_lib, "basic", llama_dir, MAX_TOKENS, *PROMPTS, mode=mode,
                      env={"CAPI_TEST_TP": str(tp)}))
    texts = [_unescape(line[5:]) for line in out.splitlines() if line.startswith("TEXT ")]
    # C strings cannot carry NUL: the C ABI delivers U+FFFD for it
    assert texts == [reference[i][0].replace("\0", "\ufffd") for i in range(len(PROMPTS))]
    toks = next(line for line in out.splitlines() if line.startswith("TOKENS")).split()[1:]
    assert [int(t) for t in toks] == reference[len(PROMPTS)][1]
    for line in out.splitlines():
        if line.startswith("FINISH "):
            assert f"COMPLETION_TOKENS {MAX_TOKENS}" in line and line.split()[1] == "length"


def test_quantization_and_kv_cache_dtype_fields(capi_test_bin, capi_lib, llama_dir):
    """vllm_model_params.quantization / kv_cache_dtype reach the engine: fp8 at load with an
    FP8 KV cache serves; a method the checkpoint is not quantized with is refused, named."""
    from pyengine import LLM, SamplingParams

    out = _check(_run(capi_test_bin, capi_lib, "basic", llama_dir, MAX_TOKENS, PROMPTS[0],
                      env={"CAPI_TEST_QUANTIZATION": "fp8", "CAPI_TEST_KV_CACHE_DTYPE": "fp8"}, core="thread"))
    text = _unescape(next(line for line in out.splitlines() if line.startswith("TEXT "))[5:])
    llm = LLM(str(llama_dir), device="cpu", quantization="fp8", kv_cache_dtype="fp8")
    want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert text == want.replace("\0", "\ufffd")
    llm.shutdown()
    bad = _run(capi_test_bin, capi_lib, "basic", llama_dir, MAX_TOKENS, PROMPTS[0],
               env={"CAPI_TEST_QUANTIZATION": "awq"}, core="thread")
    assert "FAIL engine_load status=1" in bad.stdout and "'awq'" in bad.stdout, bad.stdout


def test_eight_threads_submit_concurrently_minimal_path(capi_test_bin, capi_lib, llama_dir):
    # global dlopen and a PATH whose python3 (if any) is not the one holding torch
    _check(_run(capi_test_bin, capi_lib, "threads", llama_dir, 6, *PROMPTS, mode="global",
                env={"PATH": "/usr/bin:/bin"}))


def test_callbacks_cancel_wait_free_and_slow(capi_test_bin, capi_lib, llama_dir):
    out = _check(_run(capi_test_bin, capi_lib, "callbacks", llama_dir, PROMPTS[0], core="thread"))
    # the other request finished while the slow callback was still blocked
    assert float(re.search(r"FAST_FINAL_MINUS_SLOW_RETURN (\S+)", out).group(1)) < 0


def _kv(out: str, key: str) -> float:
    return float(re.search(rf"\b{key} (\S+)", out).group(1))


def test_thousand_concurrent_submits_on_a_bounded_pool(capi_test_bin, capi_lib, llama_dir):
    # 1,000 requests in flight at once (256 running in the engine): every stream has the
    # text vllm_complete gives, in order, one final callback, no overlapping callbacks,
    # every callback on a "vengine-deliver" thread without the GIL (PyGILState_Check); the
    # library adds the delivery pool and its monitor, not a thread per request
    n = int(os.environ.get("VENGINE_CAPI_MANY", "1000"))
    out = _check(_run(capi_test_bin, capi_lib, "many", llama_dir, n, 4, 256, *PROMPTS,
                      env={"VENGINE_DELIVERY_THREADS": "4", "VENGINE_DELIVERY_THREADS_MAX": "16"},
                      timeout=600))
    assert int(_kv(out, "MANY")) == n
    assert 1 <= _kv(out, "DELIVERY_THREADS_PEAK") <= 16
    assert _kv(out, "THREADS_ADDED") <= 16 + 1 + 2  # pool + monitor (+ slack for torch)


def test_blocked_delivery_threads_do_not_stall_other_requests(capi_test_bin, capi_lib, llama_dir):
    # one delivery thread to start with; three callbacks block it (and the threads the
    # monitor adds) until the host lets go: four other requests still complete meanwhile
    out = _check(_run(capi_test_bin, capi_lib, "slow_pool", llama_dir, PROMPTS[0],
                      env={"VENGINE_DELIVERY_THREADS": "1"}, core="thread"))
    assert "FAST 4/4 SLOW_STILL_BLOCKED 3" in out


def test_freed_engine_handle_returns_runtime_error(capi_test_bin, capi_lib, llama_dir):
    out = _check(_run(capi_test_bin, capi_lib, "freed_engine", llama_dir, PROMPTS[0]))
    errs = [line for line in out.splitlines() if line.startswith("ERR ")]
    assert sum(e.startswith("ERR 3 ") and "freed" in e for e in errs) == 7
    assert any(e.startswith("ERR 1 ") and "not an engine handle" in e for e in errs)


def test_bad_arguments_return_status_and_message(capi_test_bin, capi_lib, llama_dir):
    out = _check(_run(capi_test_bin, capi_lib, "bad_args", llama_dir, core="thread"))
    errs = [line for line in out.splitlines() if line.startswith("ERR ")]
    assert len(errs) >= 36
    assert all(" :: " in e and e.split(" :: ", 1)[1].strip() for e in errs)
    # NaN is refused with the words the Python API and HTTP use (issue 16 kind 3)
    from pyengine import SamplingParams
    with pytest.raises(ValueError) as ei:
        SamplingParams(temperature=float("nan"))
    assert _unescape(re.search(r"^NAN_MESSAGE (.*)$", out, re.M).group(1)) == str(ei.value)
    assert _unescape(re.search(r"^CHAT_NAN_MESSAGE (.*)$", out, re.M).group(1)) == str(ei.value)
    # a 4 MiB prompt: the engine's character bound, before tokenizing (issue 16 kind 2); the
    # Python API's message, at once (tokenizing it took seconds)
    from pyengine import EngineArgs
    from pyengine.engine.processor import Processor
    from pyengine.tokenizer import load_tokenizer
    cfg = EngineArgs(model=str(llama_dir)).create_engine_config()
    with pytest.raises(ValueError) as ei:
        Processor(cfg, load_tokenizer(cfg)).check_prompt_text("fox " * (1 << 20))
    assert _unescape(re.search(r"^HUGE_MESSAGE (.*)$", out, re.M).group(1)) == str(ei.value)
    chat = _unescape(re.search(r"^CHAT_HUGE_MESSAGE (.*)$", out, re.M).group(1))
    assert "characters" in chat and f"{cfg.max_model_len} tokens" in chat
    assert _kv(out, "HUGE_SECONDS") < 2 and _kv(out, "CHAT_HUGE_SECONDS") < 2


def test_chat_matches_python_api_with_template(capi_test_bin, capi_lib, llama_dir, reference):
    req = json.dumps({"model": "ignored", "messages": [{"role": "user", "content": "Write a haiku about tests."}],
                      "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                      "stream_options": {"include_usage": True}})
    out = _check(_run(capi_test_bin, capi_lib, "chat", llama_dir, req, core="thread"))
    resp = json.loads(_unescape(next(x for x in out.splitlines() if x.startswith("CHAT "))[5:]))
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    ChatCompletion.model_validate(resp)  # the protocol layer's objects, as HTTP's
    assert resp["object"] == "chat.completion"
    choice = resp["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == reference["chat"][0]
    assert choice["finish_reason"] == "length"
    assert resp["usage"] == {"prompt_tokens": reference["chat"][1], "completion_tokens": MAX_TOKENS,
                             "total_tokens": reference["chat"][1] + MAX_TOKENS}

    out = _check(_run(capi_test_bin, capi_lib, "chat_chunks", llama_dir, req, core="thread"))
    chunks = [json.loads(_unescape(x[6:])) for x in out.splitlines() if x.startswith("CHUNK ")]
    assert out.count("CHUNK_FINAL") == 1
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == reference["chat"][0]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS


def test_chat_carries_the_reasoning_fields(capi_test_bin, capi_lib, reasoning_dir, llama_dir):
    """vllm_model_params.reasoning_parser="qwen3" on the scripted Qwen3-style model: vllm_chat's
    message and vllm_chat_stream's deltas carry reasoning_content (and reasoning) apart from
    the content, as over HTTP (tests/server/test_agent_apis.py); a tokenizer without the
    think tokens is refused at load."""
    req = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0})
    env = {"CAPI_TEST_REASONING_PARSER": "qwen3"}
    out = _check(_run(capi_test_bin, capi_lib, "chat", reasoning_dir, req, env=env, core="thread"))
    msg = json.loads(_unescape(next(x for x in out.splitlines() if x.startswith("CHAT "))[5:]))["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == ("Hmm", "Hmm", "\n\nOK")
    out = _check(_run(capi_test_bin, capi_lib, "chat_chunks", reasoning_dir, req, env=env, core="thread"))
    deltas = [c["choices"][0]["delta"] for c in (json.loads(_unescape(x[6:])) for x in out.splitlines()
                                                 if x.startswith("CHUNK ")) if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm"
    assert "".join(d.get("content", "") for d in deltas) == "\n\nOK"
    proc = _run(capi_test_bin, capi_lib, "chat", llama_dir, req, env=env, core="thread")
    assert proc.returncode != 0 and "<think>" in proc.stdout + proc.stderr


def test_chat_thinking_token_budget(capi_test_bin, capi_lib, thinking_loop_dir):
    """vllm_chat takes chat's thinking_token_budget as over HTTP: on the model that thinks
    forever, the reasoning holds exactly the budget and the answer follows; without
    vllm_model_params.reasoning_parser the budget is refused, naming the field."""
    req = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "temperature": 0,
                      "thinking_token_budget": 3})
    out = _check(_run(capi_test_bin, capi_lib, "chat", thinking_loop_dir, req,
                      env={"CAPI_TEST_REASONING_PARSER": "qwen3"}, core="thread"))
    msg = json.loads(_unescape(next(x for x in out.splitlines() if x.startswith("CHAT "))[5:]))["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("HmmHmmHmm", "\n\nOK")
    proc = _run(capi_test_bin, capi_lib, "chat", thinking_loop_dir, req, core="thread")
    assert proc.returncode != 0 and "thinking_token_budget needs a reasoning parser" in proc.stdout


def test_engine_defaults_come_from_the_generation_config(capi_test_bin, capi_lib, llama_greedy_dir):
    # the model recommends greedy sampling, top_k 7 and 3 new tokens (generation_config.json)
    from pyengine import LLM, SamplingParams

    chat = json.dumps({"messages": [{"role": "user", "content": "Write a haiku about tests."}]})
    out = _check(_run(capi_test_bin, capi_lib, "engine_defaults", llama_greedy_dir, PROMPTS[0], chat, core="thread"))
    assert "DEFAULTS temperature=0 top_p=1 top_k=7 min_p=0 repetition_penalty=1 max_tokens=3" in out
    text = _unescape(re.search(r"^TEXT (.*)$", out, re.M).group(1))
    llm = LLM(str(llama_greedy_dir), device="cpu")
    want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert text == want.text and "COMPLETION_TOKENS 3" in out
    resp = json.loads(_unescape(re.search(r"^CHAT (.*)$", out, re.M).group(1)))
    assert resp["usage"]["completion_tokens"] == 3 and resp["choices"][0]["finish_reason"] == "length"
    errs = [line for line in out.splitlines() if line.startswith("ERR ")]
    assert [e.split(" :: ")[0] for e in errs] == ["ERR 1", "ERR 1", "ERR 3"]
    assert "engine is NULL" in errs[0] and "out is NULL" in errs[1] and "freed" in errs[2]


def test_exit_with_requests_in_flight(capi_test_bin, capi_lib, llama_dir):
    reps = int(os.environ.get("VENGINE_CAPI_EXIT_REPS", "5"))
    # the hosts at once: each exits with its own requests in flight, whatever the others do
    started = [_start(capi_test_bin, capi_lib, "exit_inflight", llama_dir, PROMPTS[0]) for _ in range(reps)]
    for i, p in enumerate(started):
        proc = _finish(p, "exit_inflight", timeout=240)
        assert proc.returncode == 0 and "EXITING" in proc.stdout, \
            f"rep {i}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
        assert "Fatal Python error" not in proc.stderr and "Segmentation" not in proc.stderr


def test_forked_child_fails_fast(capi_test_bin, capi_lib, llama_dir):
    out = _check(_run(capi_test_bin, capi_lib, "fork", llama_dir, PROMPTS[0]))
    child = next(x for x in out.splitlines() if x.startswith("CHILD "))
    assert "forked" in child


def test_forked_child_may_call_exit(capi_test_bin, capi_lib, llama_dir):
    # children forked while a request streams call exit(7): each ends at once with
    # status 7, its buffered stdout flushed, the exit handler it registered after the fork
    # run and the parent's (registered before the fork) not run (include/vllm.h)
    reps = int(os.environ.get("VENGINE_CAPI_FORK_REPS", "10"))
    out = _check(_run(capi_test_bin, capi_lib, "fork_exit", llama_dir, PROMPTS[0], reps, timeout=300))
    assert f"CHILDREN_OK {reps}" in out
    assert sorted(x for x in out.splitlines() if x.startswith("CHILD ")) == \
        sorted(f"CHILD {i} 3" for i in range(reps))  # 3 == VLLM_ERR_RUNTIME
    assert out.count("CHILD_HANDLER") == reps
    assert "PRE_FORK_HANDLER_IN_CHILD" not in out


def test_broken_python_environment_fails_load(capi_test_bin, capi_lib, llama_dir, tmp_path):
    # no stdlib: the interpreter itself cannot start
    out = _check(_run(capi_test_bin, capi_lib, "load_fails", llama_dir, env={"PYTHONHOME": str(tmp_path / "nope")},
                      timeout=60))
    assert "LOAD 3" in out and "failed to start" in out
    # the engine package cannot be imported
    shadow = tmp_path / "shadow" / "pyengine"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('this pyengine is broken on purpose')\n")
    out = _check(_run(capi_test_bin, capi_lib, "load_fails", llama_dir,
                      env={"VENGINE_PYTHONPATH": f"{shadow.parent}{os.pathsep}{ROOT}"}, timeout=60))
    assert "LOAD 3" in out and "broken on purpose" in out
    # the Python interpreter named by VENGINE_PYTHON does not exist
    out = _check(_run(capi_test_bin, capi_lib, "load_fails", llama_dir,
                      env={"VENGINE_PYTHON": str(tmp_path / "no-python"), "PYTHONHOME": str(tmp_path / "nope")},
                      timeout=60))
    assert "LOAD 3" in out


def test_model_without_tokenizer_fails_load(capi_test_bin, capi_lib, no_tokenizer_dir):
    out = _check(_run(capi_test_bin, capi_lib, "load_fails", no_tokenizer_dir, timeout=120, core="thread"))
    assert "LOAD 2" in out and "cannot encode text" in out  # VLLM_ERR_MODEL_LOAD


_DIE_AFTER_STEPS = """
import sys
sys.path.insert(0, {root!r})
import pyengine.engine.core as _core
_orig = _core.EngineCore.step_fn
def _step_fn(self):
    step, n = _orig(self), [0]
    def dying_step():
        n[0] += 1
        if n[0] > 5:
            raise RuntimeError("injected engine failure")
        return step()
    return dying_step
_core.EngineCore.step_fn = _step_fn
"""


def test_engine_death_fails_requests(capi_test_bin, capi_lib, llama_dir, tmp_path):
    # the embedded interpreter imports sitecustomize from PYTHONPATH: it makes the engine
    # core's step raise after 5 steps
    (tmp_path / "sitecustomize.py").write_text(_DIE_AFTER_STEPS.format(root=str(ROOT)))
    out = _check(_run(capi_test_bin, capi_lib, "engine_dies", llama_dir, PROMPTS[0],
                      env={"PYTHONPATH": str(tmp_path)}, timeout=120))
    assert "injected engine failure" in out


@pytest.mark.parametrize("multiprocess", ["0", "1"])
def test_in_process_and_engine_process_cores_give_the_same_text(capi_test_bin, capi_lib, llama_dir, reference,
                                                                multiprocess):
    # "1": the embedded interpreter starts the engine process itself, with a PATH on which
    # no python3 holds torch (the executable must come from the library, not the host)
    out = _check(_run(capi_test_bin, capi_lib, "basic", llama_dir, MAX_TOKENS, *PROMPTS, mode="global",
                      env={"VENGINE_ENABLE_MULTIPROCESSING": multiprocess, "PATH": "/usr/bin:/bin"}))
    texts = [_unescape(line[5:]) for line in out.splitlines() if line.startswith("TEXT ")]
    assert texts == [reference[i][0].replace("\0", "\ufffd") for i in range(len(PROMPTS))]


_FAIL_MIN_TOKENS_7 = """
import sys
sys.path.insert(0, {root!r})
import pyengine.engine.core as _core
_Request = _core.Request
def _make(request_id, prompt_token_ids, sampling_params, *a, **k):
    if sampling_params.min_tokens == 7:
        raise OverflowError("injected: Overflow when unpacking long long")
    return _Request(request_id, prompt_token_ids, sampling_params, *a, **k)
_core.Request = _make
"""


def test_one_failing_request_ends_only_itself(capi_test_bin, capi_lib, llama_dir, tmp_path):
    # issue 12: vLLM's per-request error path, seen from C
    (tmp_path / "sitecustomize.py").write_text(_FAIL_MIN_TOKENS_7.format(root=str(ROOT)))
    out = _check(_run(capi_test_bin, capi_lib, "request_fails", llama_dir, PROMPTS[0],
                      env={"PYTHONPATH": str(tmp_path)}, timeout=120))
    assert "COMPLETE_STATUS 3" in out and "failed inside the engine" in out and "OverflowError: injected" in out


def test_structured_output_fields(capi_test_bin, capi_lib, llama_dir):
    """vllm.cpp's structured_* fields constrain the output; a bad constraint is
    VLLM_ERR_INVALID_ARGUMENT with the engine's message (as Python and HTTP give it)."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "c": {"enum": ["x", "y"]}}, "required": ["n", "c"]}
    out = _check(_run(capi_test_bin, capi_lib, "structured", llama_dir, json.dumps(schema), r"[a-z]{2}-[0-9]{2}", core="thread"))
    line = {m.group(1): _unescape(m.group(2)) for m in re.finditer(r"^([A-Z_]+) (.*)$", out, re.M)}
    assert line["CHOICE"] in ("yes", "no", 'a "quoted" answer') and line["CHOICE_FINISH"] == "stop"
    assert line["CHOICE_STREAM"] == line["CHOICE"]
    jsonschema.validate(json.loads(line["JSON"]), schema)
    assert re.fullmatch(r"[a-z]{2}-[0-9]{2}", line["REGEX"])
    assert re.fullmatch(r"\([0-9]\)", line["GRAMMAR"])
    # the engine's input processing decides; C gets its message word for word, as Python
    # (ValueError) and HTTP (the 400's message) do
    from pyengine import StructuredOutputsParams
    from pyengine.structured_output.backend_xgrammar import validate_structured_outputs
    for key, kw in (("ERR_REGEX", {"regex": "a("}), ("ERR_JSON", {"json": '{"type": "array", "uniqueItems": true}'})):
        with pytest.raises(ValueError) as ei:
            validate_structured_outputs(StructuredOutputsParams(**kw))
        assert line[key] == str(ei.value)
    assert "Invalid regular expression" in line["ERR_REGEX"] and "'uniqueItems' at #" in line["ERR_JSON"]
    assert "at most one of" in line["ERR_TWO"] and "structured_regex, structured_json_object" in line["ERR_TWO"]
    assert "structured_choice is NULL" in line["ERR_CHOICE"]
    assert "AFTER" in line  # the engine serves on


def test_chat_response_format(capi_test_bin, capi_lib, llama_dir):
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    req = json.dumps({"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 100,
                      "temperature": 0, "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": "r", "schema": schema}}})
    out = _check(_run(capi_test_bin, capi_lib, "chat", llama_dir, req, core="thread"))
    resp = json.loads(_unescape(next(x for x in out.splitlines() if x.startswith("CHAT "))[5:]))
    assert resp["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(resp["choices"][0]["message"]["content"]), schema)


def test_bad_words_and_allowed_token_ids(capi_test_bin, capi_lib, llama_dir, tokenizer):
    """vllm_sampling_params.bad_words / allowed_token_ids (vengine additions, appended):
    the engine's rules, as over HTTP and in Python (tests/test_llm.py)."""
    from pyengine import EngineArgs
    from pyengine.engine.processor import Processor
    from tests.helpers import banned_at, find_bad_word

    def lines(out, key):
        return {int(m.group(1)): [int(t) for t in m.group(2).split()]
                for m in re.finditer(rf"^{key} (\d+)((?: -?\d+)*)$", out, re.M)}

    processor = Processor(EngineArgs(model=str(llama_dir), device="cpu").create_engine_config(), tokenizer)
    prompts = ";".join(",".join(map(str, tokenizer.encode(p))) for p in PROMPTS)
    out = _check(_run(capi_test_bin, capi_lib, "bad_words", llama_dir, prompts, "5,9", "zzzzqq", core="thread"))
    err = {m.group(1): _unescape(m.group(2)) for m in re.finditer(r"^(ERR_[A-Z]+) (.*)$", out, re.M)}
    assert "vllm_sampling_params.bad_words is NULL but n_bad_words = 1" in err["ERR_NULL"]
    assert "bad_words must not contain empty or whitespace-only words" in err["ERR_BLANK"]
    assert "Token id 1073741824 in allowed_token_ids is out of vocabulary" in err["ERR_VOCAB"]
    assert "n_allowed_token_ids must be >= 0" in err["ERR_NEG"]
    allowed = lines(out, "ALLOWED")
    assert len(allowed) == len(PROMPTS) and all(len(v) == 24 and set(v) <= {5, 9} for v in allowed.values())
    base = lines(out, "BASE")
    outputs = [base[i] for i in range(len(PROMPTS))]
    n, word, seqs = find_bad_word(tokenizer, processor, outputs, 1)
    out = _check(_run(capi_test_bin, capi_lib, "bad_words", llama_dir, prompts, "5", word, core="thread"))
    got = lines(out, "BANNED")[n]
    i = banned_at(outputs[n], seqs)
    assert got[:i] == outputs[n][:i] and got[i] != outputs[n][i] and banned_at(got, seqs) is None, (word, seqs, got)
