"""The generation driver both OpenAI endpoints share (the HTTP half of vLLM's
``OpenAIServing``): one HTTP request's engine requests (one per prompt, ``n`` choices
each), per-choice state, metrics, and its response or SSE stream. What the objects look
like is the endpoint's ``ResponseBuilder`` (``pyengine.entrypoints.openai``), the same
one the C ABI's chat uses."""
from __future__ import annotations

import json
import logging
import uuid
from typing import Optional

from flask import Response, request

from pyengine.entrypoints.openai.serving_engine import ChoiceState, ResponseBuilder, usage

from .bridge import ClientDisconnected, RequestGroup, ServerShuttingDown, is_engine_dead
from .http import SOCKET_ENVIRON_KEY, APIError, error_body, error_response, json_response
from .metrics import RequestTimer
from .state import ServerState

logger = logging.getLogger(__name__)

_SSE_DONE = "data: [DONE]\n\n"
# a str's JSON (what json.dumps gives for it: ASCII, escaped), the C function json uses
_json_str = json.encoder.encode_basestring_ascii


class RequestFailed(Exception):
    """One engine request ended with finish_reason "error" (it failed inside the engine;
    the others go on): HTTP 500, or an error event then [DONE] once streaming began."""

    def __init__(self, error: Optional[str]):
        super().__init__(f"The request failed inside the engine: {error or 'unknown error'}")


def _sse(obj) -> str:
    """One SSE event: ``obj``'s compact JSON, or ``obj`` itself when it is that already."""
    return "data: " + (obj if type(obj) is str else json.dumps(obj, separators=(",", ":"))) + "\n\n"


class GenerationJob:
    """One HTTP request's generation. ``prompts``: (text or None, token ids) each;
    ``echo_texts``: per prompt, the text its choices start with (completions' ``echo``);
    ``cache_salt``: the engine prompts' prefix-cache salt."""

    def __init__(self, st: ServerState, builder: ResponseBuilder, prompts, sp, priority: int, *,
                 echo_texts: Optional[list] = None, include_usage: bool = False, continuous_usage: bool = False,
                 cache_salt: Optional[str] = None):
        self.st, self.builder = st, builder
        self.prompts, self.sp, self.priority = prompts, sp, priority
        self.n = sp.n
        self.want_logprobs = builder.formatter is not None
        self.echo_texts = echo_texts
        self.cache_salt = cache_salt
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.id = builder.id
        # engine request ids: unique even when clients reuse a request_id (the response id)
        self.engine_id = f"{builder.id}-{uuid.uuid4().hex[:12]}"
        # text offsets count the echoed prompt
        self.choices = [ChoiceState(len(echo_texts[idx // self.n]) if echo_texts is not None else 0)
                        for idx in range(len(prompts) * self.n)]
        self.prompt_tokens = sum(len(ids) for _, ids in prompts)
        self.timers = [RequestTimer(st.metrics) for _ in prompts]
        self.group: Optional[RequestGroup] = None
        self._recorded: set[int] = set()
        self._templates: dict[int, Optional[tuple[str, str]]] = {}  # choice -> text chunk template

    def start(self, sock) -> None:
        st = self.st
        if st.cut_message is not None:
            raise APIError(503, st.cut_message)
        self.group = RequestGroup(st.bridge, st.engine, sock)
        st.jobs.add(self)
        try:
            for i, (_, ids) in enumerate(self.prompts):
                prompt = ids if self.cache_salt is None else {"prompt_token_ids": ids, "cache_salt": self.cache_salt}
                self.group.add(f"{self.engine_id}-{i}", prompt, self.sp, self.priority)
                # counted once it is admitted, whatever its end (vLLM counts them at prefill,
                # aborted requests included): not at the end the handler may never see
                st.metrics.prompt_tokens.inc(len(ids))
        except ValueError as e:  # the engine's input processing refused it
            self.close()
            raise APIError(400, str(e), getattr(e, "parameter", None)) from None
        except Exception as e:
            self.close()
            if is_engine_dead(e, st.engine):
                raise APIError(503, f"The engine is dead: {e}") from None
            raise

    def cut(self, message: str) -> None:
        if self.group is not None:
            self.group.cancel(message)

    def close(self) -> None:
        self.st.jobs.discard(self)
        if self.group is not None:
            self.group.close()
            # requests whose end the handler never saw (client gone, engine dead, cut)
            for i in range(len(self.group.request_ids)):
                if i not in self._recorded:
                    self._record_end(i, "abort")

    def _record_end(self, i: int, reason: str, out=None) -> None:
        """Prompt ``i``'s request ended (``reason``: its finish reason, "abort" or
        "error"): counted once, whichever way it ended."""
        if i in self._recorded:
            return
        self._recorded.add(i)
        m = self.st.metrics
        m.req_prompt.observe(len(self.prompts[i][1]))
        m.req_gen.observe(sum(ch.num_tokens for ch in self.choices[i * self.n:(i + 1) * self.n]))
        m.finished(reason)
        if out is not None and reason not in ("abort", "error"):
            self.timers[i].finish(out)

    def _delta(self, i: int, o):
        """One CompletionOutput delta of prompt ``i``: the choice's state updated, and the
        event ``(choice_index, choice, text, token_ids, logprobs, finish_reason)``."""
        idx = i * self.n + o.index
        ch = self.choices[idx]
        text = o.text
        if self.echo_texts is not None and ch.num_tokens == 0 and not ch.text:
            text = self.echo_texts[i] + text
        ch.num_tokens += len(o.token_ids)
        if o.finish_reason == "error":
            self._record_end(i, "error")
            raise RequestFailed(o.error)  # the job's close() aborts its other requests
        if o.finish_reason is not None:
            ch.finish_reason, ch.stop_reason = o.finish_reason, o.stop_reason
        return idx, ch, text, o.token_ids, o.logprobs, o.finish_reason

    def events(self):
        """Yield ``(choice_index, choice, delta_text, token_ids, logprobs, finish_reason)``
        for each CompletionOutput delta, in arrival order; the choice's text is extended
        after the event is handled. A request's end is recorded when its last output is
        taken, before its events go out (a client gone at that moment does not make it
        an abort)."""
        m = self.st.metrics
        for i, out in self.group.outputs():
            events = [self._delta(i, o) for o in out.outputs]
            newest = max((len(o.token_ids) for o in out.outputs), default=0)
            if newest:
                m.generation_tokens.inc(sum(len(o.token_ids) for o in out.outputs))
                self.timers[i].observe(out, newest)
            if out.finished:
                chosen = self.choices[i * self.n:(i + 1) * self.n]
                self._record_end(i, next((ch.finish_reason for ch in chosen if ch.finish_reason), None)
                                 or "abort", out)
            for event in events:
                yield event
                if event[2]:
                    event[1].text.append(event[2])

    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def usage(self, completion_tokens: Optional[int] = None) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens() if completion_tokens is None else completion_tokens)

    def run_to_end(self) -> dict:
        """The whole response object."""
        lp_acc: dict[int, list] = {}
        keep_ids = self.want_logprobs or self.builder.needs_token_ids
        for idx, _, _, token_ids, logprobs, _ in self.events():
            if keep_ids and token_ids:
                lp_acc.setdefault(idx, []).append((token_ids, logprobs))
        choices = []
        for idx, ch in enumerate(self.choices):
            parts = lp_acc.get(idx, [])
            tids = [t for p in parts for t in p[0]]
            lps = [x for p in parts for x in (p[1] or [None] * len(p[0]))]
            choices.append(self.builder.choice(idx, ch, tids, lps))
        return self.builder.response(choices, self.prompt_tokens, self.completion_tokens())

    def _chunks(self):
        """The stream's chunks: dicts, or (the common text delta) their JSON text."""
        for chunk in self.builder.first_chunks(len(self.choices)):
            if self.continuous_usage:
                chunk["usage"] = self.usage(0)
            yield chunk
        templates = self._templates
        plain = not self.want_logprobs and not self.continuous_usage
        for idx, ch, text, token_ids, logprobs, finish in self.events():
            if not text and not token_ids and finish is None:
                continue  # nothing new; a token without text yet still has its chunk (vLLM)
            if plain and finish is None:
                # the common streamed delta: the builder's chunk JSON around the text's JSON
                t = templates[idx] if idx in templates else templates.setdefault(
                    idx, self.builder.text_delta_template(idx))
                if t is not None:
                    yield t[0] + _json_str(text) + t[1]
                    continue
            chunks = self.builder.delta_chunks(idx, ch, text, token_ids, logprobs, finish)
            if chunks and self.continuous_usage:
                chunks[-1]["usage"] = self.usage()
            yield from chunks
        if self.include_usage:
            yield self.builder.chunk([], usage=self.usage())

    def stream(self, view=None):
        """The SSE stream: the chunks, then ``[DONE]``; an error once streaming began is an
        error event (OpenAI's error body) before ``[DONE]``. ``view``: an endpoint built on
        chat (``serving_responses.ResponsesJob``, ``serving_messages.MessagesJob``) that
        frames the chunks as its own events (``sse_events``, ``sse_error``, ``sse_done``)."""
        def error(status: int, msg: str) -> str:
            return _sse(error_body(status, msg)) if view is None else view.sse_error(status, msg)
        try:
            if view is None:
                for chunk in self._chunks():
                    yield _sse(chunk)
            else:
                yield from view.sse_events(self._chunks())
        except ClientDisconnected:
            return
        except RequestFailed as e:
            yield error(500, str(e))
        except ServerShuttingDown as e:
            yield error(503, str(e))
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            if is_engine_dead(e, self.st.engine):
                status, msg = 503, f"The engine is dead: {e}"
            else:
                logger.exception("error while streaming %s", self.id)
                status, msg = 500, f"Internal error while streaming: {type(e).__name__}: {e}"
            yield error(status, msg)
        done = _SSE_DONE if view is None else view.sse_done
        if done:
            yield done


def run_job(job: GenerationJob, stream: bool, view=None) -> Response:
    """Start ``job`` and answer: an SSE stream, or the whole response once finished.
    ``view``: an endpoint built on chat that translates the stream (``GenerationJob.stream``)
    and the response (``view.response(chat_completion)``)."""
    job.start(request.environ.get(SOCKET_ENVIRON_KEY))
    if stream:
        resp = Response(job.stream(view), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        resp.call_on_close(job.close)
        return resp
    try:
        obj = job.run_to_end()
        return json_response(obj if view is None else view.response(obj))
    except ClientDisconnected:
        return Response(status=499)
    except RequestFailed as e:
        return error_response(500, str(e))
    except ServerShuttingDown as e:
        return error_response(503, str(e))
    except Exception as e:
        if is_engine_dead(e, job.st.engine):
            return error_response(503, f"The engine is dead: {e}")
        raise
    finally:
        job.close()
