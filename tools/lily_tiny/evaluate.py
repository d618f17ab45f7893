#!/usr/bin/env python3
"""Check a lily-tiny Hugging Face checkpoint on the CPU, and plot its loss curve.

* loads the folder with ``AutoModelForCausalLM`` / ``AutoTokenizer`` (bf16 weights,
  computed in fp32 here unless --dtype bf16);
* held-out perplexity: the held-out text (documents joined by <|endoftext|>),
  or its first --tokens tokens, cut into consecutive windows of --window
  tokens, each evaluated from an empty state; every token but the first is
  scored; compared with the uniform baseline ln(vocab);
* greedy generation from a few prompts (plain text and a ChatML chat);
* with --loss-log and --plot: draws train and held-out loss against tokens seen
  (needs matplotlib, a tools-only dependency).

Usage:
    python3 tools/lily_tiny/evaluate.py --model .tiny_work/hf \
        --heldout docs/lily-tiny/heldout.txt \
        --loss-log OUT/loss_log.json --plot docs/lily-tiny/loss.png
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

PROMPTS = [
    'def read_lines(path):\n    """',
    "The `with` statement is used to",
    "import os\nimport sys\n\n\ndef main():\n",
]
CHAT = [{"role": "user", "content": "What does `shutil.copyfile` do?"}]


def perplexity(model, ids: torch.Tensor, window: int):
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, ids.numel() - 1, window):
            chunk = ids[i : i + window + 1]
            if chunk.numel() < 2:
                break
            logits = model(input_ids=chunk[None, :-1], use_cache=False).logits.float()[0]
            total += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
            count += chunk.numel() - 1
    return total / count, count


def plot(loss_log: str, out: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(loss_log) as f:
        d = json.load(f)
    tr = d["log"]
    ev = d["evals"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot([r["tokens"] / 1e6 for r in tr], [r["loss"] for r in tr], label="train (mean of 10 steps)", lw=1.2)
    ax.plot([e["tokens"] / 1e6 for e in ev], [e["heldout_loss"] for e in ev], "o-", label="held-out", ms=3, lw=1.2)
    ax.axhline(d["uniform_loss"], color="gray", ls=":", lw=1, label=f"uniform ln({d['config']['vocab_size']})")
    ax.axvline(d["saved_step"] * d["args"]["batch_size"] * d["args"]["seq_len"] / 1e6, color="k", ls="--", lw=0.8,
               label=f"saved (step {d['saved_step']})")
    per_epoch = d["train_tokens"] / 1e6
    secax = ax.secondary_xaxis("top", functions=(lambda x: x / per_epoch, lambda e: e * per_epoch))
    secax.set_xlabel("epochs")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, max(10, d["uniform_loss"] + 0.5))
    ax.set_title(f"lily-tiny: {d['params'] / 1e6:.1f}M params, {d['steps']} steps on {d['device']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    ap.add_argument("--heldout", help="held-out text file (docs/lily-tiny/heldout.txt)")
    ap.add_argument("--tokens", type=int, default=0, help="score only the first N held-out tokens (0: all)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--loss-log")
    ap.add_argument("--plot")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    print(f"{type(model).__name__}: {n:,} params, vocab {vocab}, dtype {args.dtype}")

    if args.heldout:
        with open(args.heldout, encoding="utf-8") as f:
            text = f.read()
        ids = tok(text)["input_ids"]
        ids = torch.tensor(ids[: args.tokens + 1] if args.tokens > 0 else ids)
        t0 = time.time()
        loss, count = perplexity(model, ids, args.window)
        print(
            f"held-out: {count} tokens scored, loss {loss:.4f} nats, perplexity {math.exp(loss):.2f} "
            f"(uniform: loss {math.log(vocab):.4f}, perplexity {vocab}); {time.time() - t0:.1f}s"
        )

    for p in PROMPTS:
        enc = tok(p, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
        print("---- prompt:", repr(p))
        print(tok.decode(out[0][enc["input_ids"].shape[1] :]))
    enc = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=2 * args.max_new_tokens, do_sample=False)
    new = out[0][enc["input_ids"].shape[1] :]
    print("---- chat:", repr(CHAT[0]["content"]))
    print(tok.decode(new))
    print(f"(stopped on eos: {int(new[-1]) in model.generation_config.eos_token_id})")

    if args.loss_log and args.plot:
        plot(args.loss_log, args.plot)


if __name__ == "__main__":
    main()
