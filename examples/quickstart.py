"""Load a model, stream a completion, then branch the conversation with a snapshot.

    python examples/quickstart.py [MODEL]      # MODEL: folder, Hugging Face repo id, or lily-tiny (default)
"""

import sys

import lily

engine = lily.Engine.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else None)
print(engine.report(), "\n")

session = engine.session(max_context=1024)
session.prefill(engine.tokenize("Once upon a time"))
branch_point = session.snapshot()

for piece in session.generate_text(40):  # greedy
    print(piece, end="", flush=True)
print("\n---")

session.restore(branch_point)  # same prompt, sampled continuation
for piece in session.generate_text(40, lily.SamplingParams(temperature=0.8, top_p=0.95, seed=3)):
    print(piece, end="", flush=True)
print()
