"""LLM: offline batched generation (mirrors vllm/entrypoints/llm.py)."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from pyengine.config import EngineArgs
from pyengine.engine.llm_engine import LLMEngine
from pyengine.outputs import RequestOutput
from pyengine.sampling_params import RequestOutputKind, SamplingParams

_ENGINE_ARG_NAMES = {f.name for f in dataclasses.fields(EngineArgs)}


class LLM:
    """``LLM(model=None, **engine_args)``: model=None loads the built-in default model.
    No periodic stats log unless ``disable_log_stats=False`` is given (as vLLM's LLM).

    Raises ValueError for unknown engine arguments or bad values."""

    def __init__(self, model: str | None = None, **kwargs):
        unknown = sorted(set(kwargs) - _ENGINE_ARG_NAMES)
        if unknown:
            raise ValueError(f"Unknown engine argument(s): {', '.join(unknown)}.")
        kwargs.setdefault("disable_log_stats", True)  # as vLLM's LLM: no periodic stats lines offline
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args.create_engine_config())
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses when given no sampling parameters: vLLM's neutral
        defaults overridden by the model's generation config (``generation_config``
        engine argument: "auto", "vllm" or a directory), as vLLM's method of the same
        name. A new object each call."""
        return self.llm_engine.processor.get_default_sampling_params()

    @staticmethod
    def _normalize_prompts(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one tokenized prompt
        return prompts

    def generate(self, prompts: str | Sequence,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of strings, or a list of token-id
        lists); returns one finished RequestOutput per prompt, in input order.

        Raises ValueError for any bad prompt or parameter before anything runs."""
        prompts = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"Got {len(params)} sampling params for {len(prompts)} prompts.")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts.")
        engine = self.llm_engine
        ids = [str(next(self._counter)) for _ in prompts]
        # Validate (and tokenize) everything first so one bad prompt queues nothing.
        processed = [engine.processor.process(rid, p, sp.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                                              priority[i] if priority is not None else 0)
                     for i, (rid, p, sp) in enumerate(zip(ids, prompts, params))]
        for rid, proc in zip(ids, processed):
            engine.add_processed(rid, proc)
        return self._run_engine(ids, use_tqdm)

    def chat(self, messages: Sequence, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate the next assistant message of one conversation (a list of
        ``{"role", "content"}`` dicts) or of each of a list of conversations (mirrors
        vllm/entrypoints/llm.py's ``LLM.chat``). Each is rendered with the tokenizer's chat
        template (or ``chat_template``, a Jinja string), encoded without adding special
        tokens (the template has them), and generated as by ``generate``: one finished
        RequestOutput per conversation, in order (``prompt`` is None, as vLLM's;
        ``prompt_token_ids`` is the rendered prompt). ``add_generation_prompt``,
        ``continue_final_message``, ``tools`` and ``chat_template_kwargs`` go to the
        template.

        Raises ValueError before anything runs: no chat template (the tokenizer has none
        and none was given: there is no fallback format), a malformed message, both
        ``add_generation_prompt`` and ``continue_final_message``, a template error, or
        any ``generate`` error."""
        from pyengine.chat_utils import apply_hf_chat_template, parse_chat_messages

        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple)):
            conversations = list(messages)
        else:
            conversations = [messages]
        tok = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = apply_hf_chat_template(tok, parse_chat_messages(conversation), chat_template,
                                          add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, tools=tools,
                                          chat_template_kwargs=chat_template_kwargs)
            # the engine's cheap character bound first: an over-long rendering is never tokenized
            prompts.append(self.llm_engine.processor.encode_prompt(text, add_special_tokens=False,
                                                                   parameter="messages"))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        n_out = 0
        try:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix(output_toks=n_out, refresh=False)
        except BaseException:
            self.llm_engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``LLM.reset_prefix_cache``), e.g. to measure
        without cache hits. Returns False, and changes nothing, while requests hold KV
        blocks (never the case between two ``generate`` calls)."""
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release the engine's device memory (model, KV cache, CUDA graphs) and its
        tensor-parallel workers and process group; the LLM is unusable afterwards. Lets a
        second engine (or another library) use the GPU in the same process. Also done when
        the LLM is garbage-collected (``del llm; gc.collect()``, as vLLM's docs advise)."""
        self.llm_engine.shutdown()
