"""Sessions keep the KV cache and the Gated DeltaNet state: prefill a document once,
then ask several continuations from a snapshot of it without reading it again.

    python examples/sessions.py [MODEL]
"""

import inspect
import json
import sys

import lily

model = lily.Model.load(sys.argv[1] if len(sys.argv) > 1 else "lily-tiny")

document = inspect.getsource(json.decoder)[:3000]  # a long prompt, read once
session = model.prefill(document)
print(f"prefilled {session.position} tokens")

after_document = session.snapshot()
for start in ("\ndef parse_", "\nclass "):
    session.restore(after_document)  # back to the state right after the document
    r = session.generate(start, max_tokens=30, temperature=0)
    print(f"--- {start!r} ({r.prompt_tokens} new prompt tokens)\n{start}{r.text}")

# Teacher-forced logits: the next-token distribution at every position.
ids = model.encode("import os\nimport sys\n")
logits = model.logits(ids)
print("next-token argmax:", [model.decode([t]) for t in logits.argmax(-1)])
