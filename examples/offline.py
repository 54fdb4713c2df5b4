"""Offline batched generation with the Python API (progress bar included).

    python examples/offline.py                       # the built-in default code model, CPU or GPU
    python examples/offline.py --model /path/to/hf-model-dir --temperature 0.7
"""
import argparse

from pyengine import LLM, SamplingParams

PROMPTS = [
    'def read_lines(path):\n    """Return the lines of a text file."""',
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
    "class Stack:\n    def push(self, item):",
    "import json\n\ndef load_config(path):",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: the built-in code model)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    llm = LLM(args.model, device=args.device)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    for out in llm.generate(PROMPTS, params):
        print("=" * 72)
        print(out.prompt + out.outputs[0].text)
        print(f"-- {len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}")


if __name__ == "__main__":
    main()
