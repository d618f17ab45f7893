"""One streamed chat turn with the checkpoint's chat template.

    python examples/chat_stream.py [MODEL] "your question"
"""

import sys

import lily

model = sys.argv[1] if len(sys.argv) > 2 else None
question = sys.argv[-1] if len(sys.argv) > 1 else "Tell me a short story."
engine = lily.Engine.from_pretrained(model)
for piece in engine.chat([{"role": "user", "content": question}], max_tokens=128, stream=True):
    print(piece, end="", flush=True)
print()
