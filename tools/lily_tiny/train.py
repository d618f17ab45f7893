#!/usr/bin/env python3
"""Train lily-tiny (a small Qwen3.5/3.6-MoE text model) with transformers.

The model is ``transformers.Qwen3_5MoeForCausalLM`` built from a config JSON
(tools/lily_tiny/config.json). Training keeps the model's weights in bf16 and
an fp32 master copy of every parameter inside AdamW (the bf16 weights are
refreshed from the masters after each step). Batches are random windows of
``--seq-len + 1`` tokens from the pre-tokenized training stream (train.npy,
uint16, documents separated by <|endoftext|>). LR: linear warm-up, then cosine
decay to ``--min-lr-frac`` of the peak. The loss is the next-token cross-entropy
plus ``router_aux_loss_coef`` times the MoE load-balancing loss.

The number of steps is either fixed (``--steps``) or, with ``--train-seconds``,
derived from the speed of the first steps so that training fits that time
(the step count used is printed and logged, so a run can be repeated with
``--steps``). ``--max-epochs`` caps the step count in either case.

Held-out loss is measured on heldout.npy cut into non-overlapping windows of
``--seq-len`` tokens. The weights with the lowest held-out loss seen are the
ones saved.

Writes into --out-dir: ``model/`` (save_pretrained, bf16 safetensors shards,
config.json) and ``loss_log.json``.

Usage (CPU smoke test with a toy config):
    python3 tools/lily_tiny/train.py --config tools/lily_tiny/config.json \
        --data-dir .tiny_work/data --out-dir OUT --steps 3 --batch-size 2 --seq-len 128 \
        --override '{"num_hidden_layers": 4}'
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F


def log(*a):
    print(*a, flush=True)


def build_model(config_path: str, override: dict, device, seed: int):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    with open(config_path) as f:
        cfg = json.load(f)
    cfg.update(override)
    if "num_hidden_layers" in override and "layer_types" not in override:
        interval = cfg.get("full_attention_interval", 4)
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(cfg["num_hidden_layers"])
        ]
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype")}
    config = Qwen3_5MoeTextConfig(**cfg)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(config)  # fp32 init, deterministic given the seed
    return model.to(device=device, dtype=torch.bfloat16)


def lm_and_aux_loss(model, x, y):
    out = model(input_ids=x, output_router_logits=True, use_cache=False)
    lm = F.cross_entropy(out.logits.float().view(-1, out.logits.shape[-1]), y.reshape(-1))
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), device=x.device)
    return lm, aux


@torch.no_grad()
def heldout_loss(model, held: torch.Tensor, seq_len: int, batch: int) -> float:
    model.eval()
    n = (held.numel() - 1) // seq_len
    xs = held[: n * seq_len].view(n, seq_len)
    ys = held[1 : n * seq_len + 1].view(n, seq_len)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        logits = model(input_ids=xs[i : i + batch], use_cache=False).logits.float()
        y = ys[i : i + batch].reshape(-1)
        total += F.cross_entropy(logits.view(-1, logits.shape[-1]), y, reduction="sum").item()
        count += ys[i : i + batch].numel()
    model.train()
    return total / count


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--override", default="{}", help="JSON dict merged into the config (tests)")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=0, help="fixed number of steps (0: use --train-seconds)")
    ap.add_argument("--train-seconds", type=float, default=420.0)
    ap.add_argument("--calib-steps", type=int, default=20)
    ap.add_argument("--max-epochs", type=float, default=0.0, help="cap on tokens seen / train tokens (0: none)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-batch", type=int, default=64)
    ap.add_argument("--heldout-tokens", type=int, default=0, help="use only the first N held-out tokens (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-size", default="14MB")
    args = ap.parse_args()

    t_start = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        log("device:", torch.cuda.get_device_name(0))
    import transformers

    log(f"torch {torch.__version__}, transformers {transformers.__version__}")

    train_np = np.load(os.path.join(args.data_dir, "train.npy"))
    held_np = np.load(os.path.join(args.data_dir, "heldout.npy"))
    train = torch.from_numpy(train_np.astype(np.int64)).to(device)
    if args.heldout_tokens > 0:
        held_np = held_np[: args.heldout_tokens]
    held = torch.from_numpy(held_np.astype(np.int64)).to(device)
    log(f"train tokens {train.numel():,}, held-out tokens {held.numel():,}")

    override = json.loads(args.override)
    model = build_model(args.config, override, device, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"params {n_params:,}; experts implementation {model.config._experts_implementation}")
    vocab = model.config.vocab_size
    log(f"uniform baseline loss ln({vocab}) = {math.log(vocab):.4f}")

    # Probe one forward/backward; fall back to a slower experts implementation if needed.
    px = train[: 2 * args.seq_len].view(2, args.seq_len)
    for impl in ("grouped_mm", "batched_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            lm, aux = lm_and_aux_loss(model, px, px)
            (lm + aux).backward()
            break
        except Exception as e:  # noqa: BLE001
            log(f"experts implementation {impl} failed: {type(e).__name__}: {str(e)[:300]}")
    model.zero_grad(set_to_none=True)
    log(f"experts implementation in use: {model.config._experts_implementation}")

    params = [p for p in model.parameters()]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    decay = [m for p, m in zip(params, masters) if p.ndim >= 2]
    no_decay = [m for p, m in zip(params, masters) if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )

    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed + 1)
    offs = torch.arange(args.seq_len + 1, device=device)

    def batch():
        hi = train.numel() - args.seq_len - 1
        starts = torch.randint(0, hi, (args.batch_size,), device=device, generator=gen)
        w = train[starts[:, None] + offs]
        return w[:, :-1], w[:, 1:]

    tokens_per_step = args.batch_size * args.seq_len
    total_steps = args.steps if args.steps > 0 else None
    epoch_cap = int(args.max_epochs * train.numel() / tokens_per_step) if args.max_epochs > 0 else None
    if total_steps is not None and epoch_cap is not None:
        total_steps = min(total_steps, epoch_cap)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        T = total_steps if total_steps is not None else 10**9
        prog = min(1.0, (step - args.warmup) / max(1, T - args.warmup))
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

    log_rows, evals = [], []
    best = {"loss": float("inf"), "step": -1, "state": None}

    def do_eval(step):
        hl = heldout_loss(model, held, args.seq_len, args.eval_batch)
        evals.append({"step": step, "tokens": step * tokens_per_step, "heldout_loss": hl, "time": time.time() - t_train})
        if hl < best["loss"]:
            best.update(loss=hl, step=step, state=[p.detach().clone() for p in params])
        log(f"  eval step {step}: held-out loss {hl:.4f} ppl {math.exp(hl):.2f}")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    model.train()
    t_train = time.time()
    do_eval(0)
    step, calib_t0 = 0, None
    acc_lm, acc_aux, acc_n = 0.0, 0.0, 0
    while total_steps is None or step < total_steps:
        lr = lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch()
        lm, aux = lm_and_aux_loss(model, x, y)
        loss = lm + model.config.router_aux_loss_coef * aux
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        gnorm = torch.nn.utils.clip_grad_norm_(masters, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        acc_lm += lm.detach()
        acc_aux += aux.detach()
        acc_n += 1
        step += 1

        if total_steps is None:
            if step == 5:
                sync()
                calib_t0 = time.time()
            elif step == 5 + args.calib_steps:
                sync()
                dt = (time.time() - calib_t0) / args.calib_steps
                left = args.train_seconds - (time.time() - t_train)
                # keep ~6% of the time for the periodic held-out evaluations
                total_steps = step + max(0, int(0.94 * left / dt))
                if epoch_cap is not None:
                    total_steps = min(total_steps, max(step, epoch_cap))
                log(
                    f"calibration: {dt * 1000:.1f} ms/step, {tokens_per_step / dt:,.0f} tokens/s; "
                    f"total steps {total_steps} ({total_steps * tokens_per_step / train.numel():.2f} epochs)"
                )

        if step % args.log_every == 0 or step == total_steps:
            sync()
            row = {
                "step": step,
                "tokens": step * tokens_per_step,
                "lr": lr,
                "loss": (acc_lm / acc_n).item(),
                "aux_loss": (acc_aux / acc_n).item(),
                "grad_norm": gnorm.item(),
                "time": time.time() - t_train,
            }
            log_rows.append(row)
            acc_lm, acc_aux, acc_n = 0.0, 0.0, 0
            tps = row["tokens"] / row["time"]
            log(
                f"step {step}/{total_steps} loss {row['loss']:.4f} aux {row['aux_loss']:.3f} "
                f"gnorm {row['grad_norm']:.2f} lr {lr:.2e} {tps:,.0f} tok/s {row['time']:.0f}s"
            )
            if not math.isfinite(row["loss"]):
                sys.exit("loss is not finite")
        if step % args.eval_every == 0 and step != total_steps:
            do_eval(step)

    sync()
    train_time = time.time() - t_train
    do_eval(step)
    final = evals[-1]["heldout_loss"]
    if best["step"] != step:
        log(f"restoring the weights of step {best['step']} (held-out {best['loss']:.4f} < final {final:.4f})")
        with torch.no_grad():
            torch._foreach_copy_(params, best["state"])

    out_model = os.path.join(args.out_dir, "model")
    os.makedirs(out_model, exist_ok=True)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_model, safe_serialization=True, max_shard_size=args.max_shard_size)
    gen_cfg = os.path.join(out_model, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)  # the tokenizer build writes the real one
    summary = {
        "params": n_params,
        "config": model.config.to_dict(),
        "args": vars(args),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "train_tokens": train.numel(),
        "heldout_tokens": held.numel(),
        "steps": step,
        "tokens_seen": step * tokens_per_step,
        "epochs": step * tokens_per_step / train.numel(),
        "train_seconds": train_time,
        "final_train_loss": log_rows[-1]["loss"] if log_rows else None,
        "final_heldout_loss": final,
        "saved_step": best["step"],
        "saved_heldout_loss": best["loss"],
        "saved_heldout_ppl": math.exp(best["loss"]),
        "uniform_loss": math.log(vocab),
        "log": log_rows,
        "evals": evals,
    }
    summary["config"]["dtype"] = "bfloat16"
    with open(os.path.join(args.out_dir, "loss_log.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    if device.type == "cuda":
        log(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    for fn in sorted(os.listdir(out_model)):
        log(f"  {fn} {os.path.getsize(os.path.join(out_model, fn)) / 2**20:.2f} MiB")
    log(
        f"done: {step} steps, {step * tokens_per_step:,} tokens, {train_time:.0f}s training, "
        f"{time.time() - t_start:.0f}s total; saved step {best['step']}: held-out loss {best['loss']:.4f}, "
        f"ppl {math.exp(best['loss']):.2f} (uniform {vocab})"
    )


if __name__ == "__main__":
    main()
