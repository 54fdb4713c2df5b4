"""Shared fixtures for tests/engine: a small byte-level BPE tokenizer built in memory.

The tokenizer is trained here with the ``tokenizers`` library (nothing is downloaded) on a
corpus with multi-byte characters, and has a small vocabulary so that characters such as
"日", "本" and emoji are split over several byte tokens.
"""
import pytest

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, déjà vu, naïve résumé. Ça va très bien.",
    "日本語のテキスト。日本は美しい国です。東京と大阪。",
    "Emoji: 😀 🚀 👍🏽 ❤️ 🎉 and more 😀😀 text.",
    "Stop here. STOP! The end.\nNew line\n\nUser: hi\nAssistant: hello",
    "numbers 12345 67890 and symbols #$%&*()[]{}",
] * 4

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_test_tokenizer(vocab_size: int = 300):
    """A ``transformers.PreTrainedTokenizerFast`` over a byte-level BPE trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False)


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return build_test_tokenizer()
