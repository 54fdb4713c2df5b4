"""vengine: pip install . (or -e .) installs pyengine, server, capi and the `vengine` command.

torch is left unpinned beyond a floor so that a GPU machine keeps (or gets) its CUDA build;
the Makefile installs the pinned CPU build first on machines without a GPU."""
from setuptools import find_packages, setup

setup(
    name="vengine",
    version="0.1.0",
    description="A vLLM-v1-style LLM inference engine: Python API, OpenAI server, C ABI",
    python_requires=">=3.10",
    packages=find_packages(include=["pyengine", "pyengine.*", "server", "server.*", "capi", "capi.*"]),
    package_data={"pyengine": ["default_model/*"], "capi": ["*.c", "*.h"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "transformers>=4.51",
        "tokenizers",
        "safetensors",
        "numpy",
        "cffi>=1.15",
        "flask>=3.0",
        "gevent>=24.2",
        "cbor2",
        "pydantic>=2",
        "prometheus_client",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "openai>=1.0", "requests", "triton; platform_system=='Linux'"],
    },
    entry_points={"console_scripts": ["vengine=server.cli:main"]},
)
