"""Generate with lookupdec from Python; prints the text and how many tokens each forward gave.

    python examples/quickstart.py [MODEL_DIR]        # default: the built-in code model

The prompt asks the model to repeat a function with one change, the kind of output lookups
draft well: most of it is already in the prompt.
"""
import sys

from lookupdec import Engine

model_dir = sys.argv[1] if len(sys.argv) > 1 else "builtin"
engine = Engine.from_pretrained(model_dir)
prompt = ("def area(width, height):\n    \"\"\"Area of a rectangle.\"\"\"\n    return width * height\n\n\n"
          "def area(width, height):")  # no final newline: the tokenizer merges it with the indent
gen = engine.generate(prompt, max_new_tokens=64)
print(prompt + gen.text)
print(f"{gen.stats.mean_accepted:.2f} tokens per forward, finish: {gen.finish_reason}")
