"""The model's tokenizer (bottom vocabulary: the engine, the structured-output backend and
every front end load it the same way; mirrors vllm/transformers_utils/tokenizer.py)."""
from __future__ import annotations

from pyengine.config import EngineConfig

__all__ = ["load_tokenizer", "eos_token_ids"]

_TOKENIZER_PROBE = "Hello, world! 123"


def load_tokenizer(config: EngineConfig):
    """The model's tokenizer, checked to encode text into the model's vocabulary.

    Raises ValueError when it cannot be loaded or cannot encode text: e.g. a model
    directory without tokenizer files, where transformers can build a tokenizer with an
    empty vocabulary that turns every prompt into no tokens."""
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(config.tokenizer, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"Cannot load a tokenizer from {config.tokenizer}: {e}") from e
    try:
        ids = tok.encode(_TOKENIZER_PROBE, add_special_tokens=False)
    except Exception as e:  # noqa: BLE001 - any failure here means the tokenizer is unusable
        raise ValueError(f"The tokenizer loaded from {config.tokenizer} cannot encode text: "
                         f"{type(e).__name__}: {e}") from e
    vocab = config.hf_config.vocab_size
    if not ids:
        raise ValueError(
            f"The tokenizer loaded from {config.tokenizer} cannot encode text ({_TOKENIZER_PROBE!r} gives "
            f"no tokens): the directory has no usable tokenizer files (tokenizer.json, tokenizer.model, "
            f"vocab.json + merges.txt). Add them, or name a tokenizer directory (--tokenizer).")
    if max(ids) >= vocab:
        raise ValueError(f"The tokenizer loaded from {config.tokenizer} does not match the model: it encodes "
                         f"{_TOKENIZER_PROBE!r} to token id {max(ids)}, outside the model's vocabulary "
                         f"(size {vocab}).")
    return tok


def eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    """EOS ids from the generation config (may list several; ``--generation-config``),
    else the model config / tokenizer."""
    ids: set[int] = set()
    eos = config.try_get_generation_config().get("eos_token_id")
    if eos is None:
        eos = getattr(config.hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    return ids
