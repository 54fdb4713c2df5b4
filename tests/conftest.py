"""Session fixtures: a locally trained tokenizer and tiny random HF models (llama, qwen2
with tied embeddings, qwen3 saved sharded). Nothing is downloaded. Tests marked ``gpu``
are skipped when CUDA is unavailable."""
from __future__ import annotations

import os

# One intra-op thread for torch in the test process and every engine/server process it
# starts (they inherit the environment): the suite runs several processes at once on
# 2 cores, and torch's thread pool spinning against them made a tiny model's CPU decode
# step ~17x slower (measured: 128 steps at batch 10, 67 s with the default, 3.9 s with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import (  # noqa: E402
    REASONING_TOOL_CALL,
    build_reasoning_tokenizer,
    build_scripted_model,
    build_scripted_tokenizer,
    build_sentencepiece_tokenizer,
    build_tiny_model,
    build_tokenizer,
    build_wordpiece_tokenizer,
    reasoning_script,
    scripted_script,
    thinking_loop_script,
    with_generation_config,
)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, tokenizer_dir):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_dir, seed=1)


@pytest.fixture(scope="session")
def llama_greedy_dir(tmp_path_factory, llama_dir):
    """The tiny llama whose generation_config.json recommends greedy sampling and at most
    3 new tokens (and a top_k), as a model creator's defaults (--generation-config)."""
    return with_generation_config(llama_dir, tmp_path_factory.mktemp("llama_greedy"),
                                  temperature=0.0, top_k=7, max_new_tokens=3)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory, tokenizer_dir):
    # tied embeddings: no lm_head.weight in the checkpoint
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", tokenizer_dir, seed=2,
                            tie_word_embeddings=True)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory, tokenizer_dir):
    # sharded checkpoint (model.safetensors.index.json + several files)
    return build_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", tokenizer_dir, seed=3,
                            max_shard_size="60KB")


@pytest.fixture(scope="session")
def model_dirs(llama_dir, qwen2_dir, qwen3_dir):
    return {"llama": llama_dir, "qwen2": qwen2_dir, "qwen3": qwen3_dir}


@pytest.fixture(scope="session")
def sp_tokenizer_dir(tmp_path_factory):
    """A SentencePiece-style tokenizer (byte fallback, ``Strip`` decoder; Llama-2 kind)."""
    return build_sentencepiece_tokenizer(tmp_path_factory.mktemp("sp_tokenizer"))


@pytest.fixture(scope="session")
def wordpiece_tokenizer_dir(tmp_path_factory):
    return build_wordpiece_tokenizer(tmp_path_factory.mktemp("wordpiece_tokenizer"))


@pytest.fixture(scope="session")
def llama_sp_dir(tmp_path_factory, sp_tokenizer_dir):
    """A tiny random Llama with the SentencePiece-style tokenizer (its greedy outputs hold
    byte-fallback tokens)."""
    return build_tiny_model(tmp_path_factory.mktemp("llama_sp"), "llama", sp_tokenizer_dir, seed=4)


@pytest.fixture(scope="session")
def scripted_tokenizer_dir(tmp_path_factory):
    return build_scripted_tokenizer(tmp_path_factory.mktemp("scripted_tokenizer"))


@pytest.fixture(scope="session")
def scripted_tokenizer(scripted_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(scripted_tokenizer_dir))


@pytest.fixture(scope="session")
def scripted_dir(tmp_path_factory, scripted_tokenizer_dir, scripted_tokenizer):
    """The scripted model (tests.helpers.build_scripted_model) with scripted_script's table."""
    return build_scripted_model(tmp_path_factory.mktemp("scripted"), scripted_tokenizer_dir,
                                scripted_script(scripted_tokenizer))


@pytest.fixture(scope="session")
def reasoning_tokenizer_dir(tmp_path_factory):
    """A Qwen3-style tokenizer: <think>, </think>, <tool_call>, </tool_call> as added tokens
    that are not special, and a chat template with enable_thinking
    (tests.helpers.build_reasoning_tokenizer)."""
    return build_reasoning_tokenizer(tmp_path_factory.mktemp("reasoning_tokenizer"))


@pytest.fixture(scope="session")
def reasoning_tokenizer(reasoning_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(reasoning_tokenizer_dir))


@pytest.fixture(scope="session")
def reasoning_dir(tmp_path_factory, reasoning_tokenizer_dir, reasoning_tokenizer):
    """A scripted Qwen3-style reasoning model: after a chat prompt it says
    ``<think>Hmm</think>\n\nOK`` (``OK`` alone with enable_thinking=false)."""
    return build_scripted_model(tmp_path_factory.mktemp("reasoning"), reasoning_tokenizer_dir,
                                reasoning_script(reasoning_tokenizer))


@pytest.fixture(scope="session")
def reasoning_tool_dir(tmp_path_factory, reasoning_tokenizer_dir, reasoning_tokenizer):
    """The same, calling a tool after its reasoning:
    ``<think>Hmm</think>\n\n<tool_call>{"name": "get_weather", ...}</tool_call>``."""
    return build_scripted_model(tmp_path_factory.mktemp("reasoning_tool"), reasoning_tokenizer_dir,
                                reasoning_script(reasoning_tokenizer, REASONING_TOOL_CALL))


@pytest.fixture(scope="session")
def thinking_loop_dir(tmp_path_factory, reasoning_tokenizer_dir, reasoning_tokenizer):
    """A Qwen3-style reasoning model that thinks ``Hmm`` forever unless a thinking budget
    forces ``</think>``, after which it says ``\n\nOK`` (tests.helpers.thinking_loop_script;
    positions up to 2048, for Anthropic's 1024-token least budget)."""
    return build_scripted_model(tmp_path_factory.mktemp("thinking_loop"), reasoning_tokenizer_dir,
                                thinking_loop_script(reasoning_tokenizer), max_position_embeddings=2048)


@pytest.fixture(scope="session")
def no_tokenizer_dir(tmp_path_factory, qwen2_dir):
    """qwen2's config and weights without any tokenizer file: transformers then builds a
    Qwen2Tokenizer with an empty vocabulary that encodes every text to no tokens."""
    import shutil

    out = tmp_path_factory.mktemp("no_tokenizer")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(qwen2_dir / name, out / name)
    for f in qwen2_dir.glob("*.safetensors*"):
        shutil.copy(f, out / f.name)
    return out
