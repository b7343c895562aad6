"""Talk to `lily serve` with the official OpenAI client.

    lily serve -m lily-tiny --port 8000 &
    python examples/openai_client.py
"""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")

stream = client.chat.completions.create(
    model="lily-tiny",
    messages=[{"role": "user", "content": "Write a Python function that reverses a list."}],
    max_tokens=64,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"chat_template_kwargs": {"enable_thinking": False}},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n\nusage: {chunk.usage.prompt_tokens} prompt "
              f"({chunk.usage.prompt_tokens_details.cached_tokens} cached), "
              f"{chunk.usage.completion_tokens} completion tokens")
