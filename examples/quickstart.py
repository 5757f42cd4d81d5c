"""Generate with lookupdec from Python; prints the text and how many tokens each forward gave.

    python examples/quickstart.py [MODEL_DIR]
"""
import sys

from lookupdec import Engine

model_dir = sys.argv[1] if len(sys.argv) > 1 else "../shared/models/stories260K"
engine = Engine.from_pretrained(model_dir)
prompt = "Once upon a time, Lily saw a cat. The cat was big. Once upon a time, Lily"
gen = engine.generate(prompt, max_new_tokens=64)
print(gen.text)
print(f"{gen.stats.mean_accepted:.2f} tokens per forward, finish: {gen.finish_reason}")
