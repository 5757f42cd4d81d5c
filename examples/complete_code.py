"""Code completion through `lookupdec serve` with the official openai client.

    lookupdec serve --model PATH &               # prints: lookupdec: serving NAME at http://127.0.0.1:8000
    python examples/complete_code.py [BASE_URL]  # default $LOOKUPDEC_BASE_URL or http://127.0.0.1:8000/v1

Completes the same snippet twice: the output is the same, and the second request drafts from
the first one's output (the server's suffix cache learns across requests), so it needs fewer
model forward passes.
"""
import os
import sys

from openai import OpenAI

SNIPPET = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
'''

base_url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("LOOKUPDEC_BASE_URL", "http://127.0.0.1:8000/v1")
client = OpenAI(base_url=base_url, api_key="unused")  # the server checks no key
model = client.models.list().data[0].id

for attempt in (1, 2):
    response = client.completions.create(model=model, prompt=SNIPPET, max_tokens=64, temperature=0, stop=["\ndef "])
    stats = response.model_extra["lookupdec"]  # the server's per-request decoding statistics
    if attempt == 1:
        print(SNIPPET + response.choices[0].text)
    print(f"request {attempt}: {stats['new_tokens']} tokens in {stats['steps']} steps = "
          f"{stats['mean_accepted']:.2f} tokens per step, accepted by source {stats['accepted_by_source']}")
