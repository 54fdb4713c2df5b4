"""Parsers for models that think between a start and an end token, ``<think>`` …
``</think>`` (mirrors vllm/reasoning/basic_parsers.py, ``BaseThinkingReasoningParser``).

The tags are found by TOKEN ID: each tag must be one token of the tokenizer (looked up at
construction; a tokenizer without them is refused), so the phase of the output (reasoning or
content) changes exactly at the tag's token, never at text that merely looks like a tag. The
text is then cut where the tag's text is: text still to come is held back only while it may
be the start of an announced tag (a detokenizer or stop-string check can deliver a token's
text later than its id, and split it over two deltas), so a tag split over two deltas is
still recognised and never leaks into either part.

Phases: ``reasoning``, ``content``, and ``undecided`` (the first output token decides:
``<think>`` opens the reasoning, anything else is content; Qwen3's ``enable_thinking``
switch and older templates). The start phase comes from the prompt's tail (a template that
ends the prompt with ``<think>`` opens the reasoning, one that ends it with ``</think>``
closes it; whitespace after the tag is allowed), else from the subclass
(``default_phase``).
"""
from __future__ import annotations

from collections.abc import Sequence

from pyengine.reasoning.abs_reasoning_parsers import DeltaMessage, ReasoningParser

REASONING, CONTENT, UNDECIDED = "reasoning", "content", "undecided"
_NOT_A_TAG = -1  # stands for ordinary text when ids are derived from text


def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _ThinkSplitter:
    """One output's split state: the phase after the ids seen (``id_phase``), the phase of
    the text not yet placed (``text_phase``), tags whose ids came but whose text did not
    (``pending``: tag text, phase after it, index of its id), that text (``buf``, starting
    at offset ``pos`` of the output text), the output ids so far (``ids``) and where the
    first pending tag's text should start in the output text (``hint``)."""

    def __init__(self, parser: BaseThinkingReasoningParser, phase: str):
        self.p = parser
        self.id_phase = self.text_phase = phase
        self.pending: list[tuple[str, str, int | None]] = []  # index None: hint already taken
        self.buf = ""
        self.pos = 0
        self.ids: list[int] = []
        self.hint: int | None = None  # of pending[0]
        self.num_reasoning_tokens = 0

    def feed_ids(self, ids: Sequence[int]) -> None:
        p = self.p
        for t in ids:
            self.ids.append(t)
            if self.id_phase == UNDECIDED:
                if t == p.start_token_id:
                    self._tag(p.start_token, REASONING)
                elif t == p.end_token_id:  # reasoning the template opened: nothing of it yet
                    self._tag(p.end_token, CONTENT)
                else:
                    self.id_phase = CONTENT
                    if self.text_phase == UNDECIDED:
                        self.text_phase = CONTENT
                continue
            if self.id_phase != REASONING:
                continue
            if t == p.start_token_id:  # a repeated start tag: dropped from the reasoning
                self._tag(p.start_token, REASONING)
            elif t == p.end_token_id:
                self._tag(p.end_token, CONTENT)
            else:
                self.num_reasoning_tokens += 1

    def _tag(self, tag: str, after: str) -> None:
        if self.text_phase == UNDECIDED:
            self.text_phase = REASONING
        # Where the tag's text starts is the length of the text of the ids before it (the
        # engine's text is their decode); worked out when the text is placed (never for
        # id-only questions), checked against the text there.
        self.pending.append((tag, after, len(self.ids) - 1))
        self.id_phase = after

    def _hint(self, at: int) -> int | None:
        before = self.ids[:at]
        return None if _NOT_A_TAG in before else len(self.p.decode(before))

    def _find(self, tag: str, hint: int | None) -> tuple[int | None, int]:
        """(where ``tag`` starts in ``buf`` or None, how much of ``buf`` surely precedes it)."""
        b, n = self.buf, len(tag)
        if hint is not None and hint >= self.pos:
            rel = hint - self.pos
            if b[rel:rel + n] == tag:
                return rel, rel
            if len(b) < rel + n and tag.startswith(b[rel:]):  # the text has not reached all of it yet
                return None, min(rel, len(b))
        i = b.find(tag)  # the hint does not match the text: the text decides
        return (i, i) if i >= 0 else (None, len(b) - _held_back(b, tag))

    def feed_text(self, text: str, out: tuple[list, list]) -> None:
        self.buf += text
        while self.buf:
            if not self.pending:
                if self.text_phase == UNDECIDED:
                    return  # no token decided the phase yet
                self._emit(len(self.buf), out)
                return
            tag, after, at = self.pending[0]
            if at is not None:  # first look at this tag: where its text should be
                self.pending[0] = (tag, after, None)
                self.hint = self._hint(at)
            i, cut = self._find(tag, self.hint)
            self._emit(cut, out)
            if i is None:
                return
            self._drop(len(tag))
            self.text_phase = after
            self.pending.pop(0)

    def finish(self, out: tuple[list, list]) -> None:
        """Place what is held back. With a tag still pending, what is held is the start
        of that tag's text (the rest never came): it is the tag's, not output."""
        if self.pending:
            self.text_phase = self.pending[-1][1]
            self.pending.clear()
            self._drop(len(self.buf))
        if self.text_phase == UNDECIDED:
            self.text_phase = CONTENT
        self._emit(len(self.buf), out)

    def _emit(self, n: int, out: tuple[list, list]) -> None:
        if n:
            out[0 if self.text_phase == REASONING else 1].append(self.buf[:n])
            self._drop(n)

    def _drop(self, n: int) -> None:
        self.buf = self.buf[n:]
        self.pos += n


def _message(out: tuple[list, list]) -> DeltaMessage | None:
    reasoning, content = "".join(out[0]) or None, "".join(out[1]) or None
    return None if reasoning is None and content is None else DeltaMessage(reasoning, content)


class BaseThinkingReasoningParser(ReasoningParser):
    """A ``start_token`` … ``end_token`` reasoning parser (subclasses set the tags and
    ``default_phase``). Raises ValueError at construction when the tokenizer does not
    have each tag as one token whose text survives ``decode(skip_special_tokens=True)``
    (the engine's output text must carry the tags for the text to be cut there)."""

    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer, *, chat_template_kwargs=None, prompt_token_ids=None):
        super().__init__(tokenizer, chat_template_kwargs=chat_template_kwargs, prompt_token_ids=prompt_token_ids)
        if tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs the model's tokenizer.")
        self.start_token_id = self._token_id(tokenizer, self.start_token)
        self.end_token_id = self._token_id(tokenizer, self.end_token)
        phase = self._prompt_phase(prompt_token_ids) if prompt_token_ids else None
        self.initial_phase = phase or self.default_phase()
        self._stream = _ThinkSplitter(self, self.initial_phase)

    def _token_id(self, tokenizer, tag: str) -> int:
        tid = tokenizer.convert_tokens_to_ids(tag)
        if not isinstance(tid, int) or tokenizer.convert_ids_to_tokens(tid) != tag:
            raise ValueError(f"The {type(self).__name__} reasoning parser needs the token {tag!r} in the "
                             "tokenizer's vocabulary, and this tokenizer has no such token: choose another "
                             "--reasoning-parser (or none) for this model.")
        if tokenizer.decode([tid], skip_special_tokens=True) != tag:
            raise ValueError(f"The tokenizer's {tag!r} token is a special token that decoding skips, so the "
                             f"output text would not show where the reasoning ends; the "
                             f"{type(self).__name__} reasoning parser cannot be used with it.")
        return tid

    def decode(self, token_ids: Sequence[int]) -> str:
        """Output text of ``token_ids`` as the engine makes it (special tokens skipped)."""
        return self.model_tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def default_phase(self) -> str:
        """The start phase when the prompt's tail shows none."""
        return REASONING

    def _prompt_phase(self, prompt_token_ids: Sequence[int]) -> str | None:
        ids = list(prompt_token_ids)
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] in (self.start_token_id, self.end_token_id):
                tail = ids[i + 1:]
                if tail and self.model_tokenizer.decode(tail, skip_special_tokens=False).strip():
                    return None  # the tag belongs to an earlier turn
                return REASONING if ids[i] == self.start_token_id else CONTENT
            if len(ids) - i > 16:  # a tag that far back is not the generation prompt's
                return None
        return None

    # -- structured outputs -------------------------------------------------------

    def _phase_after(self, token_ids: Sequence[int]) -> str:
        s = _ThinkSplitter(self, self.initial_phase)
        s.feed_ids(token_ids)
        return s.id_phase

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether output ids ``input_ids`` (from the first output token) are past the
        reasoning, by the same rules as the split (O(len); per decode step use
        ``is_reasoning_end_streaming``)."""
        return self._phase_after(input_ids) == CONTENT

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Sequence[int]) -> bool:
        """Whether the reasoning ends within ``delta_ids``, the newest of the output ids
        ``input_ids`` (O(len(delta_ids))): the end tag is among them, or they start the
        output and its first token is not the start tag where that decides (qwen3's
        undecided start; that first token itself came before the decision)."""
        if self.end_token_id in delta_ids:
            return True
        first = len(input_ids) == len(delta_ids) and len(delta_ids) > 0
        return first and self.initial_phase == UNDECIDED and delta_ids[0] != self.start_token_id

    def prompt_is_reasoning_end(self) -> bool:
        return self.initial_phase == CONTENT

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        s = _ThinkSplitter(self, self.initial_phase)
        out = []
        for t in input_ids:
            tags = len(s.pending)
            s.feed_ids([t])
            if len(s.pending) == tags and s.id_phase == CONTENT:  # not a tag, and past the reasoning
                out.append(t)
        return out

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        s = _ThinkSplitter(self, self.initial_phase)
        s.feed_ids(token_ids)
        return s.num_reasoning_tokens

    # -- text ---------------------------------------------------------------------

    def _ids_from_text(self, text: str) -> list[int]:
        """Token ids standing for ``text``: each tag's id where its text is, one
        placeholder per stretch of other text."""
        ids, i = [], 0
        while True:
            hits = [(j, tag) for tag in (self.start_token, self.end_token) if (j := text.find(tag, i)) >= 0]
            if not hits:
                break
            j, tag = min(hits)
            if j > i:
                ids.append(_NOT_A_TAG)
            ids.append(self.start_token_id if tag == self.start_token else self.end_token_id)
            i = j + len(tag)
        if i < len(text):
            ids.append(_NOT_A_TAG)
        return ids

    def extract_reasoning(self, model_output: str, token_ids: Sequence[int] | None = None
                          ) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output, each None when empty; the same
        split a stream of it gives. ``token_ids``: the output's ids (without them, tags
        are taken from the text)."""
        s = _ThinkSplitter(self, self.initial_phase)
        s.feed_ids(self._ids_from_text(model_output) if token_ids is None else token_ids)
        out: tuple[list, list] = ([], [])
        s.feed_text(model_output, out)
        s.finish(out)
        msg = _message(out)
        return (None, None) if msg is None else (msg.reasoning_content, msg.content)

    def extract_reasoning_streaming(self, delta_text: str, delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        out: tuple[list, list] = ([], [])
        self._stream.feed_ids(delta_token_ids)
        self._stream.feed_text(delta_text, out)
        return _message(out)

    def finish_streaming(self) -> DeltaMessage | None:
        out: tuple[list, list] = ([], [])
        self._stream.finish(out)
        return _message(out)

    @property
    def reasoning_ended(self) -> bool:
        """The stream so far is past the reasoning (its ids reached the content)."""
        return self._stream.id_phase == CONTENT

    @property
    def num_reasoning_tokens(self) -> int:
        """Reasoning tokens streamed so far (tags excluded)."""
        return self._stream.num_reasoning_tokens
