"""Incremental detokenization and stop checking for one request.

Mirrors ``vllm/v1/engine/detokenizer.py`` (incremental decoding, stop strings, hold-back of
text that could still become a stop string); the stop-token rules are the scheduler's
(``Scheduler._check_stop``). It runs on the output-handler thread, never on the
engine-core thread.

Decoding uses the prefix/read offset scheme (as HF ``TextStreamer`` and vLLM's slow
path): the text of the token window ``[prefix_offset, end)`` minus the text of
``[prefix_offset, read_offset)`` is the new text. New text is emitted only when it does
not end in U+FFFD, so a character whose UTF-8 bytes span several byte-level BPE tokens
comes out whole, once its last byte arrived. The window starts with the last few prompt
tokens so that the first output token decodes with its context (e.g. SentencePiece's
leading space). A character whose bytes begin in the prompt and end in the output counts
as output: it comes out whole in the first delta (as with vLLM's incremental
detokenizer, which starts from the prompt's tail), and ``prompt_text_for_echo`` leaves it
out of the prompt's text.

Decoders differ in how far a token's text depends on the tokens after it, and
``DecoderTraits`` reads which kind a tokenizer has from its ``tokenizer.json``: a plain
``ByteLevel`` decoder (GPT-2 / Llama 3 / Qwen) never changes text once its character is
complete, so ``tokenizers``' ``DecodeStream`` is exact for it; SentencePiece's
``ByteFallback`` decodes a run of ``<0x..>`` tokens as one unit (valid UTF-8, or one U+FFFD
per byte when any byte of the run is bad), so a run's text is known only once the run ends;
WordPiece's ``cleanup`` rewrites spaces before punctuation and contractions across tokens.
Every kind streams the text ``tokenizer.decode`` gives for the whole output: the last
kinds through the window decoder with those holds, and at the end of a request whatever is
still held comes out (``update(..., finished=True)``).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pyengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "DecoderTraits",
    "IncrementalDetokenizer",
    "FastIncrementalDetokenizer",
    "TokenTexts",
    "make_incremental_detokenizer",
    "prompt_text_for_echo",
    "decode_output",
    "decode_logprob_token",
    "check_stop_strings",
]

# Prompt tokens kept as decoding context for the first output tokens (vLLM uses 5).
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# A rewriting decoder (WordPiece cleanup) changes at most this many trailing characters when
# a later token completes its pattern (" do not" -> " don't"; " n ' t" -> "n't"): they are
# held back until the next token or the end.
_REWRITE_HOLD = 8
# ...and its window (which cannot slide at a token boundary while text is held) is
# re-anchored this many tokens back once it grows past twice that.
_REWRITE_WINDOW = 64


@dataclass(frozen=True)
class DecoderTraits:
    """What incremental decoding must know of a tokenizer's decoder, read once per
    tokenizer (from the public ``backend_tokenizer.to_str()`` JSON).

    Attributes:
        byte_level: the decoder is ``ByteLevel`` alone: a token's text never changes with
            what follows once its character is complete (``DecodeStream`` is exact).
        byte_fallback_ids: ids of the ``<0x00>``..``<0xFF>`` tokens under a ``ByteFallback``
            decoder: a run of them decodes as one unit, known once the run ends.
        rewrites: the decoder rewrites text across tokens (WordPiece ``cleanup``).
    """
    byte_level: bool = False
    byte_fallback_ids: frozenset = frozenset()
    rewrites: bool = False

    @classmethod
    def of(cls, tokenizer) -> DecoderTraits:
        """The traits of ``tokenizer`` (a transformers tokenizer); a slow tokenizer or an
        unreadable ``tokenizer.json`` gets the window decoder's defaults."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return cls()
        try:
            spec = json.loads(backend.to_str())
        except (AttributeError, TypeError, ValueError):
            return cls()
        dec = spec.get("decoder") or {}
        parts = dec.get("decoders", []) if dec.get("type") == "Sequence" else [dec]
        kinds = {d.get("type") for d in parts if isinstance(d, dict)}
        byte_ids: frozenset = frozenset()
        if "ByteFallback" in kinds:
            vocab = backend.get_vocab()
            byte_ids = frozenset(vocab[t] for t in (f"<0x{b:02X}>" for b in range(256)) if t in vocab)
        rewrites = any(d.get("type") == "WordPiece" and d.get("cleanup", True)
                       for d in parts if isinstance(d, dict))
        return cls(byte_level=kinds == {"ByteLevel"}, byte_fallback_ids=byte_ids, rewrites=rewrites)


def _make_decoder(tokenizer, skip_special_tokens: bool):
    """Return ``decode(ids: list[int]) -> str`` without cleanup of tokenization spaces.

    Uses the Rust ``tokenizers`` backend directly when the tokenizer has one (what
    ``PreTrainedTokenizerFast.decode`` calls anyway, minus its per-call Python overhead).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        def decode(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    else:
        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=False)
    return decode


def prompt_text_for_echo(tokenizer, prompt_token_ids: Sequence[int]) -> str:
    """Text of a token-id prompt, as echoed in front of its completion (``echo``):
    ``tokenizer.decode`` without the U+FFFD of a trailing incomplete UTF-8 character,
    whose bytes the completion's first delta completes (see ``IncrementalDetokenizer``),
    so that echo + completion text is the text of all the tokens, each character once."""
    return tokenizer.decode(list(prompt_token_ids)).rstrip(_REPLACEMENT_CHAR)


def _prompt_context(decode, prompt_token_ids: Sequence[int]) -> tuple[list[int], str]:
    """The prompt's last tokens that start the decoding window, and their text without a
    trailing incomplete character (whose bytes then count as output)."""
    ctx = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
    return ctx, decode(ctx).rstrip(_REPLACEMENT_CHAR) if ctx else ""


def decode_output(tokenizer, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                  skip_special_tokens: bool = True) -> str:
    """All of a finished output's text at once, as ``IncrementalDetokenizer``'s deltas
    give it (same prompt context; bytes that never formed a character are U+FFFD, as
    ``tokenizer.decode`` gives them); for outputs that need no incremental text."""
    decode = _make_decoder(tokenizer, skip_special_tokens)
    ctx, prefix = _prompt_context(decode, prompt_token_ids)
    full = decode(ctx + list(output_token_ids))
    return full[len(prefix):] if full.startswith(prefix) else decode(list(output_token_ids))


def decode_logprob_token(tokenizer, token_id: int) -> str:
    """Text of a single token for ``Logprob.decoded_token`` (special tokens included).

    A token that is only part of a multi-byte character decodes to text containing
    U+FFFD, as in vLLM. Returns ``""`` if ``tokenizer`` is None or the id is unknown.
    """
    if tokenizer is None:
        return ""
    try:
        text = tokenizer.decode([int(token_id)], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
    except (IndexError, KeyError, OverflowError, TypeError, ValueError):
        return ""
    return text if text is not None else ""


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """Look for a stop string in the last ``new_char_count`` characters of ``output_text``
    (a match may start up to ``len(stop_str) - 1`` characters before them).

    The earliest match wins; at equal positions the one listed first in ``stop``.

    Returns:
        None, or ``(stop_str, truncate_to)``: cut the text to ``output_text[:truncate_to]``
        (the start of the match, or its end when ``include_in_output``); ``truncate_to`` is
        -1 when no cut is needed.
    """
    if not new_char_count or not stop:
        return None
    best: tuple[int, str] | None = None
    n = len(output_text)
    for s in stop:
        start = max(n - new_char_count - len(s) + 1, 0)
        idx = output_text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    if include_in_output:
        idx += len(s)
        if idx >= n:
            return s, -1
    return s, idx


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, step by step, and finds stop strings.

    Args:
        tokenizer: a transformers tokenizer (fast or slow), or None to skip
            detokenization (then text stays ``""`` and only token ids are tracked).
        prompt_token_ids: the prompt; its last few tokens are decoding context.
        params: the request's ``SamplingParams`` (``stop``, ``include_stop_str_in_output``,
            ``skip_special_tokens``, ``min_tokens`` are used).
        traits: ``DecoderTraits.of(tokenizer)``, computed here when None.

    Attributes:
        output_text: all text decoded so far (after stop-string truncation), str.
        output_token_ids: all generated token ids, list[int] (includes a stop token that
            was not detokenized).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int],
                 params: SamplingParams, traits: DecoderTraits | None = None) -> None:
        self.tokenizer = tokenizer
        # the tokenizer's decoder kind (DecoderTraits.of(tokenizer), shared by the requests
        # of one output processor); read here when not given
        self._traits = traits if traits is not None else (
            DecoderTraits.of(tokenizer) if tokenizer is not None else DecoderTraits())
        self.stop: list[str] = list(params.stop or []) if tokenizer is not None else []
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # While not finished, this many trailing chars may be held back at most.
        self.stop_buffer_length = (max(len(s) for s in self.stop) - 1
                                   if self.stop and not self.include_stop_str_in_output
                                   else 0)
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self._last_output_text_offset = 0
        # Decoding window: ids[prefix_offset:read_offset] were already emitted (context);
        # ids[read_offset:] are pending. _prefix_text caches decode(ids[prefix:read]); at
        # first the prompt's tail, whose trailing incomplete character (U+FFFD) counts as
        # not yet emitted: it comes out whole with the output token that completes it.
        self._decode = _make_decoder(tokenizer, params.skip_special_tokens) if tokenizer is not None else None
        ctx, prefix_text = _prompt_context(self._decode, prompt_token_ids) if tokenizer is not None else ([], "")
        self._ids: list[int] = ctx
        self._prefix_offset = 0
        self._read_offset = len(ctx)
        self._prefix_text: str | None = prefix_text

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    # output_text is kept as pieces, joined when read: appending a token's text to one
    # growing str copies the whole text each time (quadratic in a long stream's length).
    @property
    def output_text(self) -> str:
        parts = self._text_parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    @output_text.setter
    def output_text(self, text: str) -> None:
        self._text_parts = [text] if text else []
        self._text_len = len(text)

    def _append_text(self, text: str) -> None:
        if text:
            self._text_parts.append(text)
            self._text_len += len(text)

    def _decode_next(self) -> str:
        """Emit the text completed by the window's pending tokens ("" if none yet).

        ``_prefix_text`` is the part of the window's text already emitted (after a slide,
        the text of the context tokens alone). Text is held back while the window ends in
        an incomplete character (U+FFFD) or a byte-fallback run, and for a rewriting
        decoder its last ``_REWRITE_HOLD`` characters are held until more tokens came."""
        ids, decode = self._ids, self._decode
        assert decode is not None  # window decoding runs only with a tokenizer
        if self._prefix_text is None:
            self._prefix_text = decode(ids[self._prefix_offset:self._read_offset])
        traits = self._traits
        if ids[-1] in traits.byte_fallback_ids:
            return ""  # the run's bytes decode together once it ends
        full = decode(ids[self._prefix_offset:])
        done = self._prefix_text
        if len(full) <= len(done) or full.endswith(_REPLACEMENT_CHAR):
            # Nothing new, or a character still incomplete: wait for more tokens.
            return ""
        end = len(full) - _REWRITE_HOLD if traits.rewrites else len(full)
        if end < len(full):
            # A rewriting decoder: the window keeps the held tail's tokens.
            new_text = full[len(done):end] if end > len(done) else ""
            self._prefix_text = full[:max(end, len(done))]
            if len(ids) - self._prefix_offset > 2 * _REWRITE_WINDOW:
                self._reanchor(full)
            return new_text
        new_text = full[len(done):]
        # Slide the window: what was pending becomes context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prefix_text = None
        # Drop tokens that left the window so ids does not grow with the output.
        if self._prefix_offset > 64:
            del ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def _reanchor(self, full: str) -> None:
        """Start a rewriting decoder's window ``_REWRITE_WINDOW`` tokens back, where no
        rewrite of the held tail can reach (its text there is a suffix of ``full``)."""
        ids, decode, done = self._ids, self._decode, self._prefix_text
        assert decode is not None and done is not None  # called by _decode_next, which set both
        start = len(ids) - _REWRITE_WINDOW
        tail = decode(ids[start:])
        held = len(full) - len(done)
        if not full.endswith(tail) or held > len(tail):
            return
        del ids[:start]
        self._prefix_offset, self._read_offset = 0, len(ids)
        self._prefix_text = tail[:len(tail) - held] if held else tail

    def _flush(self) -> str:
        """The text still held back at the end of the request (an incomplete character as
        U+FFFD, a byte-fallback run, a rewriting decoder's tail), as decoding the whole
        window gives it."""
        ids, decode = self._ids, self._decode
        if self._prefix_offset >= len(ids):
            return ""
        assert decode is not None  # tokens in the window: there is a tokenizer
        done = self._prefix_text
        if done is None:
            done = decode(ids[self._prefix_offset:self._read_offset])
        full = decode(ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(ids)
        self._prefix_text = None
        return full[len(done):] if len(full) > len(done) and full.startswith(done) else ""

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool,
               finished: bool = False) -> str | None:
        """Append this step's tokens, decode them, and check stop strings.

        Args:
            new_token_ids: the tokens generated since the last call, oldest first.
            stop_terminated: True when the last of them is a stop token (EOS or a
                ``stop_token_ids`` entry) that finished the request; it is kept in
                ``output_token_ids`` but not detokenized unless
                ``include_stop_str_in_output``.
            finished: the request ends with these tokens: text still held back for
                later tokens (see ``_decode_next``) is released, so the whole text is
                what ``tokenizer.decode`` gives for all the output tokens.
        Returns:
            the stop string that matched (``output_text`` is then truncated at it, or
            just after it with ``include_stop_str_in_output``), else None. Stop strings
            are not looked for in text produced by the first ``min_tokens`` tokens.
        """
        if not new_token_ids and not finished:
            return None
        if self.stop and len(new_token_ids) > 1 and self._decode is not None:
            # Several tokens at once (speculative decoding): a stop string ends the output at
            # the token that completed it, as if they had come one per step; later ones are dropped.
            last = len(new_token_ids) - 1
            for i, tid in enumerate(new_token_ids):
                match = self.update([tid], stop_terminated and i == last, finished and i == last)
                if match is not None:
                    return match
            return None
        new_token_ids = list(new_token_ids)
        skipped_stop_token = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped_stop_token = new_token_ids.pop()
        if self._decode is None:
            self.output_token_ids.extend(new_token_ids)
            if skipped_stop_token is not None:
                self.output_token_ids.append(skipped_stop_token)
            return None

        stop_check_offset = self._text_len
        for tid in new_token_ids:
            self.output_token_ids.append(tid)
            self._ids.append(tid)
            self._append_text(self._decode_next())
            if self.min_tokens and len(self.output_token_ids) <= self.min_tokens:
                # Text of the first min_tokens tokens is never searched for stops.
                stop_check_offset = self._text_len
        if finished:
            self._append_text(self._flush())
        if skipped_stop_token is not None:
            self.output_token_ids.append(skipped_stop_token)

        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        found = check_stop_strings(self.output_text,
                                   self._text_len - stop_check_offset,
                                   self.stop, self.include_stop_str_in_output)
        if found is None:
            return None
        stop_str, truncate_to = found
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_str

    def _held_back(self) -> int:
        """How many trailing chars of ``output_text`` could still begin a stop string:
        the longest suffix that is a proper prefix of some stop string."""
        if not self.stop_buffer_length:
            return 0
        text = self.output_text
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report now.

        Args:
            finished: the request is done: everything is released.
            delta: return only the text not returned by a previous delta call; else the
                whole text so far.
        While not finished, trailing characters that could still be the start of a stop
        string (at most ``max(len(stop)) - 1``; none with ``include_stop_str_in_output``)
        are held back, so a client never sees text a stop string later removes.
        """
        held = 0 if finished else self._held_back()
        length = self._text_len - held
        if not delta:
            return self.output_text[:length]
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self.output_text[last:length]
        return ""


class TokenTexts:
    """The text of single tokens of a byte-level BPE tokenizer (GPT-2 / Llama 3 / Qwen
    style: a ``ByteLevel`` decoder), shared by the requests of one output processor and
    learnt from their streams. A ``ByteLevel`` decoder turns a token sequence into the
    concatenation of its tokens' bytes, so when a ``DecodeStream`` at a character
    boundary steps over a token and emits text, that text is the token's own, and is the
    token's text at every character boundary of every stream: ``texts[id]``. Tokens whose
    bytes end inside a character, or make invalid UTF-8 (text with U+FFFD), and added or
    special tokens are never stored. Used on one thread at a time."""

    def __init__(self, backend):
        self.added = frozenset(backend.get_added_tokens_decoder())
        self.texts: dict[int, str] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer) -> TokenTexts | None:
        """A cache for ``tokenizer``, or None when its decoder is not plain ``ByteLevel``
        (e.g. SentencePiece's, whose first-token space rule depends on context)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        try:
            from tokenizers.decoders import ByteLevel
        except ImportError:
            return None
        if backend is None or not isinstance(getattr(backend, "decoder", None), ByteLevel):
            return None
        return cls(backend)

    def learn(self, token_id: int, text: str) -> None:
        """``text``: what a stream at a character boundary emitted for ``token_id`` alone."""
        if text and token_id not in self.added and _REPLACEMENT_CHAR not in text:
            self.texts[token_id] = text


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """``IncrementalDetokenizer`` for fast (Rust) tokenizers: the same contract. With a
    plain ``ByteLevel`` decoder it decodes with ``tokenizers``' ``DecodeStream`` (one call
    into Rust per token, instead of two decodes of the token window; ~3.5x less time per
    token); the stream is primed with the prompt's tail, so the first output token decodes
    in context, and the bytes of a character that starts in the prompt stay buffered until
    an output token completes it. Other decoders (SentencePiece's byte fallback,
    WordPiece's cleanup) change earlier text with later tokens, which ``DecodeStream``
    rejects ("Invalid prefix encountered"): they take the window decoder, and so does a
    request whose stream step fails for any other reason. Mirrors
    vllm/v1/engine/detokenizer.py's FastIncrementalDetokenizer."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams,
                 token_texts: TokenTexts | None = None,
                 traits: DecoderTraits | None = None) -> None:
        super().__init__(tokenizer, prompt_token_ids, params, traits)
        self._skip = 0
        # token_texts: single-token texts to use instead of stream steps while the stream
        # holds no partial character (_pending False: its last step emitted text)
        self._token_texts = token_texts
        self._pending = True
        self._stream = None  # None: window decoding (the base class's state)
        if tokenizer is None or not self._traits.byte_level:
            return
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._ctx = list(self._ids)  # the prompt's tail, set up by the base class
        self._ctx_text = self._prefix_text or ""
        # what was stepped since the stream last emitted text: ids, and the prompt's tail as
        # one list (flattened only when flushed: no copy per token)
        self._unflushed: list[int | list[int]] = []
        emitted = self._step(self._ctx) if self._ctx else ""
        if emitted is None:  # the stream failed on the prompt: the window state stands
            return
        self._pending = bool(self._ctx) and not emitted
        # The prompt's own text is not output. A tail that ends inside a character stays
        # pending in the stream, complete text before it included, and comes out with the
        # output token that completes the character: the first deltas drop that complete
        # text (the base class's rule: only the incomplete character counts as output).
        prompt_text = self._ctx_text
        self._skip = len(prompt_text) - len(emitted) if prompt_text.startswith(emitted) else 0
        self._ids = []

    @staticmethod
    def supports(tokenizer) -> bool:
        if getattr(tokenizer, "backend_tokenizer", None) is None:
            return False
        try:
            from tokenizers.decoders import DecodeStream  # noqa: F401 - tokenizers >= 0.21
        except ImportError:
            return False
        return True

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool,
               finished: bool = False) -> str | None:
        # The common step (one token, no stop strings to look for, nothing held back from
        # the prompt) without the general path's copies and bookkeeping; same result.
        if (len(new_token_ids) == 1 and not stop_terminated and not finished and not self.stop
                and not self._skip and self._decode is not None):
            tid = new_token_ids[0]
            self.output_token_ids.append(tid)
            self._append_text(self._next_text(tid))
            return None
        return super().update(new_token_ids, stop_terminated, finished)

    def _step(self, ids) -> str | None:
        """One ``DecodeStream`` step (a token id or a list); "" while a character is
        incomplete (then the token-text cache waits for the stream to catch up); None when
        the stream failed and the request went over to window decoding."""
        stream = self._stream
        assert stream is not None  # called in stream mode only
        try:
            text = stream.step(self._backend, ids) or ""
        except Exception as e:  # tokenizers raises a bare Exception for a bad prefix
            logger.warning("DecodeStream failed (%s); this request decodes by token window", e)
            self._stream = None
            return None
        self._pending = not text
        if text:
            if self._unflushed:
                self._unflushed.clear()
        else:
            self._unflushed.append(ids)
        return text

    def _to_window(self, token_id: int) -> str:
        """Window decoding from here on (after a failed stream step): the window is the
        prompt's tail and the output so far, of which all text but ``token_id``'s was
        emitted."""
        ids = self._ctx + self.output_token_ids
        ids.pop()  # token_id, appended by the caller before decoding
        self._ids, self._prefix_offset, self._read_offset = ids, 0, len(ids)
        self._prefix_text = self._ctx_text + self.output_text
        self._skip = 0
        self._ids.append(token_id)
        return IncrementalDetokenizer._decode_next(self)

    def _next_text(self, token_id: int) -> str:
        """The text ``token_id`` completes: from the token-text cache at a character
        boundary (the same text, see TokenTexts), else from the stream or the window."""
        if self._stream is None:
            self._ids.append(token_id)
            return IncrementalDetokenizer._decode_next(self)
        cache = self._token_texts
        if self._pending or cache is None:
            text = self._step(token_id)
        else:
            text = cache.texts.get(token_id)
            if text is not None:
                return text
            text = self._step(token_id)
            if text is not None:
                cache.learn(token_id, text)
        return self._to_window(token_id) if text is None else text

    def step_delta(self, token_id: int) -> str | None:
        """``update([token_id], False)`` then ``get_next_output_text(False, True)`` in one
        call, for a streamed request with no stop strings whose text so far was all
        reported; returns None (and changes nothing) when that does not hold, and the
        caller takes the general path."""
        if (self.stop or self._skip or self._decode is None
                or self._last_output_text_offset != self._text_len):
            return None
        self.output_token_ids.append(token_id)
        text = self._next_text(token_id)
        if text:
            self._text_parts.append(text)
            self._text_len += len(text)
            self._last_output_text_offset = self._text_len
        return text

    def _decode_next(self) -> str:
        text = self._next_text(self._ids.pop())
        return self._cut_prompt_text(text)

    def _cut_prompt_text(self, text: str) -> str:
        if self._skip and text:
            cut = min(self._skip, len(text))
            text, self._skip = text[cut:], self._skip - cut
        return text

    def _flush(self) -> str:
        if self._stream is None:
            return super()._flush()
        if not self._unflushed or self._decode is None:
            return ""
        text = self._decode([t for x in self._unflushed for t in (x if isinstance(x, list) else (x,))])
        self._unflushed = []
        return self._cut_prompt_text(text)


def make_incremental_detokenizer(tokenizer, prompt_token_ids: Sequence[int],
                                 params: SamplingParams,
                                 token_texts: TokenTexts | None = None,
                                 traits: DecoderTraits | None = None) -> IncrementalDetokenizer:
    """The fast detokenizer where the tokenizer allows it, else the window-based one.
    ``token_texts``: ``TokenTexts.for_tokenizer(tokenizer)`` and ``traits``:
    ``DecoderTraits.of(tokenizer)``, both shared by many requests."""
    if tokenizer is not None and FastIncrementalDetokenizer.supports(tokenizer):
        return FastIncrementalDetokenizer(tokenizer, prompt_token_ids, params, token_texts, traits)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params, traits)
