"""Generate text, streamed, from lily-tiny (ships with lily) or any checkpoint.

    python examples/generate.py [MODEL] [PROMPT]
"""

import sys

import lily

model = lily.Model.load(sys.argv[1] if len(sys.argv) > 1 else "lily-tiny")
prompt = sys.argv[2] if len(sys.argv) > 2 else "def read_config(path):\n"

stream = model.generate(prompt, max_tokens=80, temperature=0.7, top_p=0.95, seed=0, stream=True)
print(prompt, end="")
for piece in stream:
    print(piece.text, end="", flush=True)
r = stream.result
print(f"\n\n[{model.device}] prefill {r.prefill_tokens_per_s:,.0f} tok/s, "
      f"decode {r.decode_tokens_per_s:,.0f} tok/s, finish: {r.finish_reason}")
