"""Python side of libvengine.so (runs inside the interpreter the library embeds).

The C side (capi/vengine_capi.c) owns every request's state. This module:

- loads engines (``AsyncLLM``) and keeps one ``_Bridge`` per engine handle;
- submits requests (``add_request`` with DELTA outputs) and registers the C request
  pointer under the engine request id;
- from the engine's output-handler thread (``add_output_listener``), drains the
  collectors of the requests that have new output and pushes the step's deltas into C
  with one ``vg_push`` call; no host callback ever runs on an engine thread;
- aborts requests (called from the engine's C control thread), detects a dead engine
  (watchdog poll, same thread) and shuts engines down.

Module-global state (what the embedding strictly needs, because C refers to engines by
integer id): ``_ENGINES`` (id -> _Bridge), ``_NEXT_ID`` and the ``ffi``/``lib`` pair
given to ``install``.
"""
from __future__ import annotations

import itertools
import json
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capi.chat import ChatRequestError, parse_chat_request
from pyengine import AsyncLLM, EngineArgs, EngineDeadError, RequestOutputKind, SamplingParams, StructuredOutputsParams
from pyengine.engine.processor import ProcessedRequest
from pyengine.entrypoints.openai.serving_chat import OpenAIServingChat
from pyengine.entrypoints.openai.serving_engine import DeltaDriver, chunk_json
from pyengine.entrypoints.openai.serving_models import OpenAIServingModels
from pyengine.entrypoints.output_drain import OutputDrain, Subscriber
from pyengine.entrypoints.reasoning import load_reasoning_parser
from pyengine.reasoning import ReasoningParserManager

OK, INVALID, MODEL_LOAD, RUNTIME, UNKNOWN = 0, 1, 2, 3, 4

_ENGINES: dict[int, _Bridge] = {}
_NEXT_ID = itertools.count(1)
# set by install(): the cffi module's ffi and lib (dynamic: Any to the type checker)
ffi: Any = None
lib: Any = None


class _Refused(ValueError):
    """An argument error (-> VLLM_ERR_INVALID_ARGUMENT)."""


class _Freed(RuntimeError):
    """The engine was freed while the call was on its way (-> VLLM_ERR_RUNTIME, as a
    freed handle is refused in C)."""


def _write(buf, size: int, text: str) -> None:
    if buf == ffi.NULL or size <= 0:
        return
    data = text.encode("utf-8", "replace")[: size - 1]
    ffi.memmove(buf, data + b"\0", len(data) + 1)


def _cstr(p) -> str | None:
    if p == ffi.NULL:
        return None
    return ffi.string(p).decode("utf-8")


def _request_id(num: int) -> str:
    return f"capi-{num}"


class _Live:
    """One C request in flight (a ``Subscriber``'s target): ``req``, the C ``vllm_request``
    (cdata void*, alive until its final delta); ``driver``, for a ``vllm_chat`` request,
    its OpenAI JSON (one object per line of the delta text); ``done`` once its final
    delta was pushed."""
    __slots__ = ("req", "driver", "stream", "started", "done")

    def __init__(self, req, driver: DeltaDriver | None = None, stream: bool = False):
        self.req = req
        self.driver = driver
        self.stream = stream
        self.started = False
        self.done = False

    def chat_text(self, out, failed: bool) -> bytes:
        """A chat request's delta as the lines of OpenAI JSON the C side passes on: the
        role chunk first, then the delta's chunks and, at the end, ``usage`` (streamed), or
        the ``chat.completion`` object once finished (not streamed). A failed request ends
        with no more chunks (its error goes in the delta's error)."""
        d = self.driver
        assert d is not None
        objs: list = d.first_chunks() if self.stream and not self.started else []
        self.started = True
        if not failed:
            if self.stream:
                objs += d.feed(0, out)
                if out.finished:
                    objs += d.last_chunks()
            else:
                d.accumulate(0, out)
                if out.finished:
                    objs.append(d.response())
        return "".join(chunk_json(o) + "\n" for o in objs).encode("utf-8", "replace")


@dataclass(slots=True)  # one per request per step: no __dict__
class _Delivery:
    """One ``vg_delta`` (include/vllm.h's delivery to C): the request's new ``text``
    (UTF-8), ``token_ids``, whether it ``finished``, its ``status`` (a VLLM_* code),
    ``prompt_tokens`` (-1: not known), ``finish_reason`` and ``error`` (or None)."""
    req: object
    text: bytes
    token_ids: Sequence[int]
    finished: bool
    status: int
    prompt_tokens: int
    finish_reason: str | None
    error: str | None


def _push(batch: list[_Delivery]) -> None:
    """One vg_push call for a list of deliveries."""
    n = len(batch)
    arr = ffi.new("vg_delta[]", n)
    blob = b"".join(item.text for item in batch)
    tbuf = ffi.from_buffer(blob)
    flat = [t for item in batch for t in item.token_ids]
    tokbuf = ffi.new("int32_t[]", flat) if flat else ffi.NULL
    keep = []
    off = toff = 0
    for i, item in enumerate(batch):
        d = arr[i]
        d.req = item.req
        d.text = tbuf + off
        d.text_len = len(item.text)
        off += len(item.text)
        if item.token_ids:
            d.token_ids = tokbuf + toff
            d.n_tokens = len(item.token_ids)
            toff += len(item.token_ids)
        d.finished = 1 if item.finished else 0
        d.status = item.status
        d.prompt_tokens = item.prompt_tokens
        if item.finish_reason:
            r = ffi.new("char[]", item.finish_reason.encode())
            keep.append(r)
            d.finish_reason = r
        if item.error:
            e = ffi.new("char[]", item.error.encode("utf-8", "replace"))
            keep.append(e)
            d.error = e
    lib.vg_push(arr, n)


class _Bridge:
    """One loaded engine as seen from the C ABI: the C delivery over the engine's output
    drain (``pyengine.entrypoints.output_drain``). The drain hands each step's
    subscribers to ``_on_ready`` on the engine's output-handler thread, which drains
    their collectors and pushes the deltas into C with one ``vg_push`` call."""

    def __init__(self, llm: AsyncLLM, model_name: str = "", reasoning_parser=None):
        self.llm = llm
        self.model_name = model_name  # the "model" of chat responses
        self.reasoning_parser = reasoning_parser  # vllm_model_params.reasoning_parser's class (vllm_chat*)
        self.chat = OpenAIServingChat(llm, OpenAIServingModels([model_name or "vengine"]),
                                      reasoning_parser=reasoning_parser)
        self.lock = threading.Lock()  # drains + pushes happen under it (order)
        self.closed = False
        self.drain = OutputDrain(llm, self._on_ready)

    # -- output thread ------------------------------------------------------
    def _on_ready(self, subscribers: list[Subscriber]) -> None:
        with self.lock:
            batch = [d for d in map(self._take, subscribers) if d is not None]
            if batch:
                _push(batch)

    def _end(self, sub: Subscriber) -> None:
        sub.target.done = True
        self.drain.remove(sub.request_id)

    def _take(self, sub: Subscriber) -> _Delivery | None:
        """Drain one collector (caller holds the lock)."""
        ent: _Live = sub.target
        if ent.done:
            return None
        try:
            out = sub.take()
        except EngineDeadError as e:
            self._end(sub)
            return _Delivery(ent.req, b"", (), True, RUNTIME, -1, "error", f"engine dead: {e}")
        except Exception as e:  # a collector must not break the stream of others
            self._end(sub)
            return _Delivery(ent.req, b"", (), True, UNKNOWN, -1, "error",
                             f"vengine: reading the request's output failed: {e!r}")
        if out is None:
            return None
        c = out.outputs[0]
        plen = len(out.prompt_token_ids) if out.prompt_token_ids is not None else -1
        if out.finished:
            self._end(sub)
        # finish_reason "error": this request failed inside the engine (the others go on)
        failed = c.finish_reason == "error"
        text = ent.chat_text(out, failed) if ent.driver is not None else c.text.encode("utf-8", "replace")
        return _Delivery(ent.req, text, c.token_ids, out.finished, RUNTIME if failed else OK, plen, c.finish_reason,
                         f"the request failed inside the engine: {c.error}" if failed else None)

    # -- host threads ---------------------------------------------------------
    def submit(self, req, request: ProcessedRequest, driver: DeltaDriver | None = None, stream: bool = False) -> None:
        """Queue a request the Processor validated; its deltas go to the C request ``req``."""
        with self.lock:
            if self.closed:
                raise _Freed("the engine was freed (vllm_engine_free)")
        sub = self.drain.add(request, _Live(req, driver, stream))
        with self.lock:  # output may already be waiting: drain it now
            delivery = self._take(sub)
            if delivery is not None:
                _push([delivery])

    def fail_all(self, status: int, message: str) -> None:
        with self.lock:
            batch = []
            for sub in self.drain.subscribers():
                d = self._take(sub)  # a final output may be waiting
                if d is not None:
                    batch.append(d)
                if not sub.target.done:
                    self._end(sub)
                    batch.append(_Delivery(sub.target.req, b"", (), True, status, -1, "abort", message))
            if batch:
                _push(batch)

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.drain.close()
        try:
            self.llm.shutdown()
        finally:
            self.fail_all(RUNTIME, "vllm_engine_free: the engine was freed while the request was running")


# ---------------------------------------------------------------------------
# argument conversion

_UNSUPPORTED_MODEL_STRINGS = ("tool_parser", "kv_transfer_config")


def _engine_args(p) -> EngineArgs:
    model = _cstr(p.model_path)
    if not model:
        raise _Refused("vllm_model_params.model_path is NULL or empty")
    for name in _UNSUPPORTED_MODEL_STRINGS:
        if _cstr(getattr(p, name)):
            raise _Refused(f"vllm_model_params.{name} is set, but vengine does not support it")
    kw: dict[str, Any] = {"model": model}
    spec = _cstr(p.speculative_config)
    if spec:  # vLLM's speculative_config JSON object; its keys are checked by EngineArgs
        try:
            kw["speculative_config"] = json.loads(spec)
        except ValueError as e:
            raise _Refused(f"vllm_model_params.speculative_config is not valid JSON: {e}") from None
    tok = _cstr(p.tokenizer_config_path)
    if tok:
        tp = Path(tok)
        kw["tokenizer"] = str(tp.parent if tp.is_file() else tp)
    if p.block_size > 0:
        kw["block_size"] = int(p.block_size)
    if p.num_blocks > 0:
        kw["num_gpu_blocks_override"] = int(p.num_blocks)
    if p.max_model_len > 0:
        kw["max_model_len"] = int(p.max_model_len)
    if p.max_num_seqs > 0:
        kw["max_num_seqs"] = int(p.max_num_seqs)
    if p.enable_prefix_caching not in (0, 1, 2):
        raise _Refused(f"vllm_model_params.enable_prefix_caching must be 0, 1 or 2, got {p.enable_prefix_caching}")
    if p.enable_prefix_caching:
        kw["enable_prefix_caching"] = p.enable_prefix_caching == 1
    if p.max_num_batched_tokens > 0:
        kw["max_num_batched_tokens"] = int(p.max_num_batched_tokens)
    policy = _cstr(p.scheduling_policy)
    if policy:
        kw["scheduling_policy"] = policy
    if p.enable_jump_forward == 1:
        raise _Refused("vllm_model_params.enable_jump_forward=1: vengine does not support jump-forward decoding")
    if p.enable_jump_forward not in (0, 2):
        raise _Refused(f"vllm_model_params.enable_jump_forward must be 0, 1 or 2, got {p.enable_jump_forward}")
    devices = {0: "auto", 1: "cpu", 2: "cuda"}
    if p.device not in devices:
        raise _Refused(f"vllm_model_params.device must be 0 (auto), 1 (cpu) or 2 (cuda), got {p.device}")
    kw["device"] = devices[p.device]
    if p.gpu_memory_utilization != 0:
        kw["gpu_memory_utilization"] = float(p.gpu_memory_utilization)
    if p.kv_cache_memory_bytes < 0:
        raise _Refused(f"vllm_model_params.kv_cache_memory_bytes must be >= 0, got {p.kv_cache_memory_bytes}")
    if p.kv_cache_memory_bytes > 0:
        kw["kv_cache_memory_bytes"] = int(p.kv_cache_memory_bytes)
    if p.tensor_parallel_size < 0:
        raise _Refused(f"vllm_model_params.tensor_parallel_size must be >= 0, got {p.tensor_parallel_size}")
    if p.tensor_parallel_size > 0:
        kw["tensor_parallel_size"] = int(p.tensor_parallel_size)
    for name in ("quantization", "kv_cache_dtype"):  # validated (named) by create_engine_config
        value = _cstr(getattr(p, name))
        if value:
            kw[name] = value
    return EngineArgs(**kw)


def _strings(arr, n: int, what: str) -> list[str]:
    if n < 0:
        raise _Refused(f"vllm_sampling_params.n_{what} must be >= 0, got {n}")
    if n == 0:
        return []
    if arr == ffi.NULL:
        raise _Refused(f"vllm_sampling_params.{what} is NULL but n_{what} = {n}")
    out = []
    for i in range(n):
        if arr[i] == ffi.NULL:
            raise _Refused(f"vllm_sampling_params.{what}[{i}] is NULL")
        try:
            out.append(ffi.string(arr[i]).decode("utf-8"))
        except UnicodeDecodeError as e:
            raise _Refused(f"vllm_sampling_params.{what}[{i}] is not valid UTF-8: {e}") from None
    return out


def _token_ids(arr, n: int, what: str) -> list[int] | None:
    """An ``int32_t`` array field of vllm_sampling_params (None when n is 0)."""
    if n < 0:
        raise _Refused(f"vllm_sampling_params.n_{what} must be >= 0, got {n}")
    if n == 0:
        return None
    if arr == ffi.NULL:
        raise _Refused(f"vllm_sampling_params.{what} is NULL but n_{what} = {n}")
    return list(ffi.unpack(arr, n))


def _cstr_field(sp, name: str):
    """A ``const char*`` field of vllm_sampling_params as str (None when NULL)."""
    v = getattr(sp, name)
    if v == ffi.NULL:
        return None
    try:
        return ffi.string(v).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Refused(f"vllm_sampling_params.{name} is not valid UTF-8: {e}") from None


def _structured_outputs(sp):
    """vllm.cpp's structured-output fields -> StructuredOutputsParams (None when unset).
    The schema / regex / grammar itself is checked when the request is submitted (the
    engine's input processing), with the same messages as Python and HTTP."""
    if sp.structured_json_object not in (0, 1):
        raise _Refused(f"vllm_sampling_params.structured_json_object must be 0 or 1, got {sp.structured_json_object}")
    given = {"json": _cstr_field(sp, "structured_json"), "regex": _cstr_field(sp, "structured_regex"),
             "grammar": _cstr_field(sp, "structured_grammar"),
             "choice": _strings(sp.structured_choice, sp.n_structured_choice, "structured_choice") or None,
             "json_object": True if sp.structured_json_object else None}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    if len(given) > 1:
        names = {"json": "structured_json", "regex": "structured_regex", "grammar": "structured_grammar",
                 "choice": "structured_choice", "json_object": "structured_json_object"}
        raise _Refused("vllm_sampling_params: set at most one of structured_json, structured_regex, structured_choice, "
                       f"structured_grammar, structured_json_object (got {', '.join(names[k] for k in given)})")
    try:
        return StructuredOutputsParams(**given)
    except ValueError as e:
        raise _Refused(str(e).replace("structured_outputs.", "vllm_sampling_params.structured_")) from None


def _sampling(sp) -> tuple[SamplingParams, int]:
    if sp.logits_processor != ffi.NULL:
        raise _Refused("vllm_sampling_params.logits_processor is set, but vengine does not support it")
    for flag in ("ignore_eos", "has_seed"):  # documented 0 / 1, like structured_json_object
        if getattr(sp, flag) not in (0, 1):
            raise _Refused(f"vllm_sampling_params.{flag} must be 0 or 1, got {getattr(sp, flag)}")
    structured = _structured_outputs(sp)
    try:
        params = SamplingParams(
            temperature=float(sp.temperature), top_p=float(sp.top_p), top_k=int(sp.top_k),
            min_p=float(sp.min_p), max_tokens=int(sp.max_tokens) if sp.max_tokens > 0 else None,
            seed=_seed_bits(int(sp.seed)) if sp.has_seed else None,
            presence_penalty=float(sp.presence_penalty), frequency_penalty=float(sp.frequency_penalty),
            repetition_penalty=float(sp.repetition_penalty), min_tokens=int(sp.min_tokens),
            ignore_eos=bool(sp.ignore_eos), stop=_strings(sp.stop, sp.n_stop, "stop"),
            output_kind=RequestOutputKind.DELTA, structured_outputs=structured,
            bad_words=_strings(sp.bad_words, sp.n_bad_words, "bad_words") or None,
            allowed_token_ids=_token_ids(sp.allowed_token_ids, sp.n_allowed_token_ids, "allowed_token_ids"))
    except _Refused:
        raise
    except ValueError as e:  # the engine's message, word for word (as HTTP and Python get it)
        raise _Refused(str(e)) from None
    return params, int(sp.priority)


def _fill_sampling(out, params: SamplingParams) -> None:
    """The fields of a ``vllm_sampling_params`` that default sampling parameters set
    (``vllm_engine_sampling_params_default``); max_tokens None is 0 (the model length)."""
    out.temperature, out.top_p, out.top_k = params.temperature, params.top_p, params.top_k
    out.min_p, out.repetition_penalty = params.min_p, params.repetition_penalty
    out.presence_penalty, out.frequency_penalty = params.presence_penalty, params.frequency_penalty
    out.max_tokens = min(params.max_tokens or 0, (1 << 31) - 1)
    out.min_tokens = min(params.min_tokens, (1 << 31) - 1)


def _seed_bits(seed: int) -> int:
    """The C field is uint64_t (vllm.cpp's layout); the engine's seed range is int64
    (vLLM's). Every uint64 value is valid: it is read as the int64 with the same bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _bridge(eng_id: int) -> _Bridge:
    br = _ENGINES.get(eng_id)
    if br is None or br.closed:
        raise _Freed("the engine was freed (vllm_engine_free)")
    return br


def _fail(err, errlen: int, message: str, status: int) -> int:
    """Write ``message`` into the C error buffer; returns ``status``."""
    _write(err, errlen, message)
    return status


def _status_of(e: BaseException) -> int:
    if isinstance(e, (_Refused, ValueError, UnicodeDecodeError)):
        return INVALID
    if isinstance(e, (EngineDeadError, _Freed)):
        return RUNTIME
    return UNKNOWN


def _message(e: BaseException) -> str:
    if isinstance(e, (ValueError, EngineDeadError, _Freed)):
        return str(e) or type(e).__name__
    return "".join(traceback.format_exception_only(type(e), e)).strip()


# ---------------------------------------------------------------------------
# the functions C calls (extern "Python")

def _vg_py_load(p, eng_id_out, name_buf, namelen, err, errlen):
    try:
        args = _engine_args(p)
        reasoning = _cstr(p.reasoning_parser) or None
        if reasoning is not None:
            try:
                ReasoningParserManager.get_reasoning_parser(reasoning)
            except ValueError as e:
                raise _Refused(f"vllm_model_params.reasoning_parser: {e}") from None
        model = Path(args.model)
        if not model.is_dir():
            return _fail(err, errlen, f"vllm_engine_load: model_path {args.model!r} is not a directory", MODEL_LOAD)
        if not (model / "config.json").is_file():
            return _fail(err, errlen, f"vllm_engine_load: model_path {args.model!r} has no config.json", MODEL_LOAD)
        try:
            args.create_engine_config()  # argument errors -> INVALID_ARGUMENT
        except ValueError as e:
            return _fail(err, errlen, f"vllm_engine_load: {e}", INVALID)
        llm = AsyncLLM.from_engine_args(args)
    except _Refused as e:
        return _fail(err, errlen, f"vllm_engine_load: {e}", INVALID)
    except BaseException as e:
        return _fail(err, errlen, f"vllm_engine_load: loading the model failed: {_message(e)}", MODEL_LOAD)
    try:
        eid = next(_NEXT_ID)
        name = str(llm.config.served_model_name or model.name)
        try:
            parser = load_reasoning_parser(reasoning, llm.tokenizer)
        except ValueError as e:
            llm.shutdown()
            return _fail(err, errlen, f"vllm_engine_load: vllm_model_params.reasoning_parser: {e}", INVALID)
        _ENGINES[eid] = _Bridge(llm, name, parser)
        eng_id_out[0] = eid
        _write(name_buf, namelen, name)
        return OK
    except BaseException as e:
        try:
            llm.shutdown()
        except BaseException:
            pass
        return _fail(err, errlen, f"vllm_engine_load: {_message(e)}", UNKNOWN)


def _vg_py_submit(eng_id, req, num, prompt, toks, ntoks, sp, err, errlen):
    try:
        br = _bridge(eng_id)
        params, priority = _sampling(sp)
        if prompt != ffi.NULL:
            try:
                text = ffi.string(prompt).decode("utf-8")
            except UnicodeDecodeError as e:
                raise _Refused(f"prompt is not valid UTF-8: {e}") from None
        else:
            text = list(ffi.unpack(toks, ntoks))
        br.submit(req, br.llm.processor.process(_request_id(int(num)), text, params, priority))
        return OK
    except BaseException as e:
        return _fail(err, errlen, _message(e), _status_of(e))


def _vg_py_submit_chat(eng_id, req, num, raw, stream, err, errlen):
    try:
        br = _bridge(eng_id)
        parsed = parse_chat_request(ffi.string(raw).decode("utf-8"), br.llm.processor, RequestOutputKind.DELTA,
                                    br.reasoning_parser)
        driver = br.chat.driver(parsed.request, parsed.inputs, f"chatcmpl-{parsed.request_id or f'vengine-{int(num)}'}",
                                br.model_name, include_usage=bool(parsed.flags & 1), continuous_usage=False,
                                token_only_chunks=False)
        br.submit(req, br.chat.engine_request(parsed.inputs, _request_id(int(num))), driver, bool(stream))
        return OK
    except UnicodeDecodeError as e:
        return _fail(err, errlen, f"chat request: request_json is not valid UTF-8: {e}", INVALID)
    except ChatRequestError as e:
        return _fail(err, errlen, f"chat request: {e}", INVALID)
    except BaseException as e:
        return _fail(err, errlen, _message(e), _status_of(e))


def _vg_py_default_params(eng_id, out, err, errlen):
    try:
        _fill_sampling(out, _bridge(eng_id).llm.get_default_sampling_params())
        return OK
    except BaseException as e:
        return _fail(err, errlen, _message(e), _status_of(e))


def _vg_py_abort(eng_id, nums, n):
    br = _ENGINES.get(eng_id)
    if br is None or br.closed:
        return
    try:
        br.llm.abort([_request_id(x) for x in ffi.unpack(nums, n)])
    except BaseException:
        pass  # a dead engine is caught by the poll below


def _vg_py_poll(eng_id):
    br = _ENGINES.get(eng_id)
    if br is None or br.closed:
        return
    if br.llm.errored:
        err = br.llm.dead_error
        br.fail_all(RUNTIME, f"engine dead: {err!r}" if err is not None else "engine dead")


def _vg_py_engine_free(eng_id):
    br = _ENGINES.pop(eng_id, None)
    if br is not None:
        try:
            br.close()
        except BaseException:
            traceback.print_exc()


def install(ffi_, lib_) -> None:
    """Bind the functions C calls (extern "Python") to the library's ``ffi``/``lib``."""
    global ffi, lib
    ffi, lib = ffi_, lib_
    ffi.def_extern(name="_vg_py_load", error=UNKNOWN)(_vg_py_load)
    ffi.def_extern(name="_vg_py_submit", error=UNKNOWN)(_vg_py_submit)
    ffi.def_extern(name="_vg_py_submit_chat", error=UNKNOWN)(_vg_py_submit_chat)
    ffi.def_extern(name="_vg_py_default_params", error=UNKNOWN)(_vg_py_default_params)
    ffi.def_extern(name="_vg_py_abort")(_vg_py_abort)
    ffi.def_extern(name="_vg_py_poll")(_vg_py_poll)
    ffi.def_extern(name="_vg_py_engine_free")(_vg_py_engine_free)
