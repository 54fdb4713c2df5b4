"""Talk to ``vengine serve`` with the official ``openai`` client.

    vengine serve /path/to/model --port 8000      # or: python -m server /path/to/model
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1
"""
import argparse

import openai


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if it has one")
    a = p.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key)

    model = client.models.list().data[0].id
    print("model:", model)

    r = client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=32, temperature=0)
    print("completion:", repr(r.choices[0].text), r.usage)

    print("chat stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Write a Python hello world."}],
        max_tokens=48, temperature=0.7, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        elif chunk.usage:
            print("\nusage:", chunk.usage)


if __name__ == "__main__":
    main()
