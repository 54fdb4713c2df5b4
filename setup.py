"""vengine: pip install . (or -e .) installs pyengine, server, capi and the `vengine` command.

torch is left unpinned beyond a floor so that a GPU machine keeps (or gets) its CUDA build;
the Makefile installs the pinned CPU build first on machines without a GPU."""
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    """Ships include/vllm.h inside the capi package, so `python -m capi.build` also works
    from an installed (non-editable) copy."""

    def run(self):
        super().run()
        dst = Path(self.build_lib) / "capi"
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(__file__).parent / "include" / "vllm.h", dst / "vllm.h")

setup(
    name="vengine",
    version="0.1.0",
    description="A vLLM-v1-style LLM inference engine: Python API, OpenAI server, C ABI",
    python_requires=">=3.11",
    packages=find_packages(include=["pyengine", "pyengine.*", "server", "server.*", "capi", "capi.*"])
    # data folders (the model, the page, the kernels' tile tables): listed so setuptools
    # ships them quietly
    + ["pyengine.default_model", "server.static", "pyengine.layers.fused_moe.configs", "pyengine.ops.configs"],
    package_data={"pyengine.default_model": ["*"], "capi": ["*.c", "*.h"], "server.static": ["*"],
                  "pyengine.layers.fused_moe.configs": ["*.json"], "pyengine.ops.configs": ["*.json"]},
    cmdclass={"build_py": BuildPy},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "transformers>=4.51",
        "tokenizers",
        "safetensors",
        "numpy",
        "cffi>=1.15",
        "flask>=3.0",
        "flask-cors>=6.0",
        "gevent>=24.2",
        "cbor2",
        "pydantic>=2",
        "prometheus_client",
        "tqdm",
        "xgrammar>=0.2",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "openai>=1.0", "anthropic", "requests", "jsonschema", "hypothesis",
                 "triton; platform_system=='Linux'", "ruff", "mypy",
                 # writes the llm-compressor-format checkpoints of tests/quantization (llmcompressor
                 # itself pins transformers <= 5.17, below ours) and lets transformers load them
                 "compressed-tensors>=0.20",
                 # drives headless Chromium for the page test (tests/server/test_page.py)
                 "selenium>=4.11",
                 # issue 29: KV events (publisher and a vLLM-typed subscriber), the router end-to-end
                 # test, benchmarks/serve.py's aiohttp client
                 "pyzmq", "msgpack", "msgspec", "vllm-router", "aiohttp"],
        # --kv-events-config (ZMQ publisher of vLLM's KV events)
        "kv-events": ["pyzmq", "msgpack"],
    },
    entry_points={"console_scripts": ["vengine=server.cli:main"]},
)
