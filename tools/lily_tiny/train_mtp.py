#!/usr/bin/env python3
"""Train an MTP head (multi-token prediction block, MODEL.md section 7) for the shipped lily-tiny.

The main model is the shipped MLX 4-bit lily-tiny, read with Lily's own checkpoint code and dequantized
into transformers' ``Qwen3_5MoeForCausalLM`` (lily.evaluate.transformers_model, the model
``lily eval --reference transformers`` runs), frozen: bf16 on a GPU, fp32 on the CPU. The block
(tools/lily_tiny/mtp_torch.py) has Lily's semantics: its row t takes (token t+1, h_t), h_t the main
model's hidden after the final norm, at RoPE position t, and its logits (through the main model's
lm_head) predict token t+2.

Loss: distillation from the main model. Speculative decoding accepts a draft when it equals the model's
own choice, so the target of row t is the main model's distribution at t+1 (cross-entropy against
softmax(main logits[t+1]); the logged ``kl`` subtracts its entropy), optionally plus ``--text-ce``
times the cross-entropy on the text token t+2, plus ``router_aux_loss_coef`` times the MoE
load-balancing loss of the block's router (as train.py). Batches are random windows of ``--seq-len + 1``
tokens of the training stream (train.npy, made with the shipped tokenizer); every window gives
``--seq-len`` block rows.

Initialisation (``--init``): "main" (default) copies the main model's last full-attention layer into the
block's decoder layer and the final norm into mtp.norm, and sets fc = [I | I]; "random" is transformers'
init. "main" starts from a trained attention layer, a balanced router and experts of the right scale.

Optimiser as train.py: bf16 weights (fp32 on the CPU) with fp32 master copies inside AdamW (betas 0.9 /
0.95, weight decay on matrices), gradient clipping, linear warm-up then cosine decay. The step count is
``--steps`` or, with ``--steps 0``, fitted into ``--train-seconds`` from the speed of the first steps
(the count is logged, so a run can be repeated with ``--steps``).

Held-out evaluation every ``--eval-every`` steps on heldout.npy cut into windows (the main model's
outputs there are computed once): the distillation loss, the teacher-forced acceptance rate (argmax of
block row t == argmax of the main model at t+1) and, for k = 2..``--chain-k``, a chained estimate: draft
j (j > 1) feeds the block its own draft token and hidden (as Lily does) at position t+j-1, attending to
the teacher-forced rows up to t and to the earlier drafts of its own chain, and is compared with the
main model's argmax at t+j on the held-out text (exact while the model's greedy path is the text; the
true acceptance is measured by Lily's ``Session.mtp_stats()`` after packaging). ``accept_len_k`` is
1 + sum over j <= k of P(drafts 1..j all accepted): tokens per verify forward. The weights with the best
teacher-forced acceptance are kept.

Writes into --out-dir: ``mtp.safetensors`` (bf16, ``mtp.*`` names of the Qwen release with per-expert
experts, what Lily's HF loader and tools/lily_tiny/package_mtp.py read) and ``mtp_log.json`` (config,
arguments, seed, losses, every evaluation, timings).

Usage (GPU: tools/lily_tiny/train_mtp_device.sh; CPU smoke run, about a minute):
    python3 tools/lily_tiny/train_mtp.py --data-dir .tiny_work/data --out-dir OUT \\
        --steps 3 --batch-size 2 --seq-len 64 --heldout-tokens 2048 --eval-every 2 --eval-batch 4
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
try:
    import lily.evaluate  # noqa: F401  (an installed Lily)
except ImportError:
    sys.path.insert(0, os.path.join(REPO, "src"))  # the checkout's pure-Python part (no extension needed)

from mtp_torch import KVStore, MtpBlock, block_logits  # noqa: E402


def log(*a):
    print(*a, flush=True)


def load_main(model_dir: str, device, dtype, max_positions: int):
    from lily.checkpoint import load_checkpoint
    from lily.evaluate import transformers_model

    ck = load_checkpoint(model_dir)
    try:
        model = transformers_model(ck, max_positions=max_positions)
    finally:
        ck.close()
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def main_outputs(model, x):
    """Hidden after the final norm [B, T, H] and logits [B, T, V] of the frozen model."""
    out = model.model(input_ids=x, use_cache=False)
    h = out.last_hidden_state
    return h, model.lm_head(h)


class RouterLogits:
    """Collects the block router's logits for the load-balancing loss (a forward hook on mlp.gate)."""

    def __init__(self, router):
        self.logits = []
        router.register_forward_hook(lambda mod, inp, out: self.logits.append(out[0]))

    def take(self):
        out, self.logits = tuple(self.logits), []
        return out


def chain_mask(n: int, s: int, device) -> torch.Tensor:
    """Keys for chain step s (1-based) over n anchors: the teacher-forced rows 0..t, then the rows of chain
    steps 2..s at anchor t only. Bool [1, 1, n, s * n], True = attend."""
    idx = torch.arange(n, device=device)
    parts = [idx[None, :] <= idx[:, None]] + [torch.eye(n, dtype=torch.bool, device=device)] * (s - 1)
    return torch.cat(parts, dim=1)[None, None]


@torch.no_grad()
def evaluate(model, block, held_x, held_h, held_logits, batch: int, chain_k: int) -> dict:
    """Held-out distillation loss, teacher-forced acceptance, chained acceptance estimates (see the docstring)."""
    block.eval()
    emb, rot = model.model.embed_tokens, model.model.rotary_emb
    n_win, T = held_x.shape
    n = T - 1  # block rows per window
    kl_sum, rows, acc = 0.0, 0, torch.zeros(chain_k, dtype=torch.float64)
    anchors = torch.zeros(chain_k, dtype=torch.float64)
    for i in range(0, n_win, batch):
        x, h, ml = held_x[i : i + batch], held_h[i : i + batch], held_logits[i : i + batch]
        B = x.shape[0]
        m = ml.argmax(-1)  # the model's own token after each position
        pos = torch.arange(n, device=x.device)[None].expand(B, -1)
        cache = KVStore()
        g = block(emb(x[:, 1:]), h[:, :-1], pos, rot, attention_mask=chain_mask(n, 1, x.device), cache=cache)
        lg = block_logits(model, g).float()
        p = F.softmax(ml[:, 1:].float(), -1)
        kl = (p * (torch.log(p.clamp_min(1e-30)) - F.log_softmax(lg, -1))).sum(-1)
        kl_sum += kl.sum().item()
        rows += kl.numel()
        d = lg.argmax(-1)
        ok = d == m[:, 1:]  # row t drafts token t+2; the model's choice for it is m[t+1]
        run = ok.clone()
        for s in range(1, chain_k + 1):
            if s > 1:  # chain step s: anchor t drafts token t+1+s at position t+s-1
                pos_s = (torch.arange(n, device=x.device) + s - 1)[None].expand(B, -1)
                g = block(emb(d), g, pos_s, rot, attention_mask=chain_mask(n, s, x.device), cache=cache)
                d = block_logits(model, g).float().argmax(-1)
                valid = n - s + 1  # anchors with a model token at t+s
                run = run[:, :valid] & (d[:, :valid] == m[:, s:])
            # anchors counted for every k: those with all chain_k targets inside the window
            keep = n - chain_k + 1
            acc[s - 1] += run[:, :keep].sum().item()
            anchors[s - 1] += run[:, :keep].numel()
    block.train()
    rate = (acc / anchors).tolist()
    out = {"kl": kl_sum / rows, "accept_rate": rate[0],
           "chain_accept": {str(s): rate[s - 1] for s in range(1, chain_k + 1)}}
    cum = 1.0
    for s in range(1, chain_k + 1):
        cum += rate[s - 1]
        out[f"accept_len_{s}"] = cum
    return out


def lr_at(step: int, total: int | None, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    T = total if total is not None else 10**9
    prog = min(1.0, (step - args.warmup) / max(1, T - args.warmup))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO, "src", "lily", "models", "lily-tiny"),
                    help="the main model (Lily-readable checkpoint folder; default: the shipped lily-tiny)")
    ap.add_argument("--data-dir", required=True, help="folder with train.npy / heldout.npy (uint16)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--seq-len", type=int, default=512, help="block rows per window (windows of seq-len + 1)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--text-ce", type=float, default=0.0, help="weight of the CE on the text token t+2")
    ap.add_argument("--init", choices=("main", "random"), default="main")
    ap.add_argument("--steps", type=int, default=0, help="fixed number of steps (0: fit --train-seconds)")
    ap.add_argument("--train-seconds", type=float, default=170.0)
    ap.add_argument("--calib-steps", type=int, default=10)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--chain-k", type=int, default=4, help="chained estimate up to this many drafts")
    ap.add_argument("--heldout-tokens", type=int, default=0, help="use only the first N held-out tokens (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.chain_k < 1 or args.chain_k >= args.seq_len:
        ap.error(f"--chain-k {args.chain_k}: must be at least 1 and below --seq-len")

    t_start = time.time()
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        log("device:", torch.cuda.get_device_name(0))
    import transformers

    log(f"torch {torch.__version__}, transformers {transformers.__version__}, compute {dtype}")

    train_np = np.load(os.path.join(args.data_dir, "train.npy"))
    held_np = np.load(os.path.join(args.data_dir, "heldout.npy"))
    if args.heldout_tokens > 0:
        held_np = held_np[: args.heldout_tokens]
    W = args.seq_len + 1
    n_held = len(held_np) // W
    if n_held == 0:
        sys.exit(f"heldout.npy: {len(held_np)} tokens, fewer than one window of {W}")
    train = torch.from_numpy(train_np.astype(np.int64)).to(device)
    held_x = torch.from_numpy(held_np[: n_held * W].astype(np.int64).reshape(n_held, W)).to(device)
    log(f"train tokens {train.numel():,}; held-out {n_held} windows of {W}")

    model = load_main(args.model, device, dtype, W)
    cfg = model.config
    if int(train.max()) >= cfg.vocab_size or int(held_x.max()) >= cfg.vocab_size:
        sys.exit(f"--data-dir {args.data_dir}: token ids beyond the model's vocabulary ({cfg.vocab_size})")
    block = MtpBlock(cfg)
    if args.init == "main":
        block.init_from_main(model)
    else:
        block.init_random(args.seed)
    block = block.to(device=device, dtype=dtype).train()
    n_params = sum(p.numel() for p in block.parameters())
    log(f"main model loaded from {args.model} ({time.time() - t_start:.1f}s); MTP block {n_params:,} params, "
        f"init {args.init}")
    router = RouterLogits(block.layers[0].mlp.gate)
    emb, rot = model.model.embed_tokens, model.model.rotary_emb

    # The frozen model's outputs on the held-out windows, once.
    hs, ls = [], []
    for i in range(0, n_held, args.eval_batch):
        h, lg = main_outputs(model, held_x[i : i + args.eval_batch])
        hs.append(h)
        ls.append(lg)
    held_h, held_logits = torch.cat(hs), torch.cat(ls)
    del hs, ls
    main_acc = (held_logits[:, :-1].argmax(-1) == held_x[:, 1:]).float().mean().item()
    log(f"main model held-out top-1 accuracy {main_acc:.4f}")

    # Probe one forward/backward; fall back to a slower experts implementation if needed (as train.py).
    px = train[: 2 * W].view(2, W)
    for impl in ("grouped_mm", "batched_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            h, _ = main_outputs(model, px)
            g = block(emb(px[:, 1:]), h[:, :-1], torch.arange(W - 1, device=device)[None].expand(2, -1), rot)
            block_logits(model, g).float().sum().backward()
            router.take()
            break
        except Exception as e:  # noqa: BLE001
            log(f"experts implementation {impl} failed: {type(e).__name__}: {str(e)[:300]}")
    block.zero_grad(set_to_none=True)
    log(f"experts implementation in use: {cfg._experts_implementation}; attention {cfg._attn_implementation}")

    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    params = list(block.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(
        [{"params": [m for p, m in zip(params, masters) if p.ndim >= 2], "weight_decay": args.weight_decay},
         {"params": [m for p, m in zip(params, masters) if p.ndim < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)

    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed + 1)
    offs = torch.arange(W, device=device)
    pos = torch.arange(args.seq_len, device=device)[None].expand(args.batch_size, -1)

    def step_loss():
        starts = torch.randint(0, train.numel() - W, (args.batch_size,), device=device, generator=gen)
        x = train[starts[:, None] + offs]
        h, ml = main_outputs(model, x)
        g = block(emb(x[:, 1:]), h[:, :-1], pos, rot)
        lg = block_logits(model, g).float()
        logq = F.log_softmax(lg, -1)
        p = F.softmax(ml[:, 1:].float(), -1)
        soft = -(p * logq).sum(-1).mean()
        ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
        loss = soft
        text = torch.zeros((), device=device)
        if args.text_ce > 0:  # rows 0..T-3 have a text token t+2 in the window
            text = F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), x[:, 2:].reshape(-1))
            loss = loss + args.text_ce * text
        aux = load_balancing_loss_func(router.take(), cfg.num_experts, cfg.num_experts_per_tok)
        loss = loss + cfg.router_aux_loss_coef * aux
        acc = (lg.argmax(-1) == ml[:, 1:].argmax(-1)).float().mean()
        return loss, {"kl": soft - ent, "text_ce": text, "aux": aux, "accept": acc}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    tokens_per_step = args.batch_size * args.seq_len
    total_steps = args.steps if args.steps > 0 else None
    log_rows, evals = [], []
    best = {"accept": -1.0, "kl": float("inf"), "step": -1, "state": None}

    def do_eval(step):
        t0 = time.time()
        r = evaluate(model, block, held_x, held_h, held_logits, args.eval_batch, args.chain_k)
        sync()
        r.update(step=step, time=time.time() - t_train, eval_seconds=time.time() - t0)
        evals.append(r)
        if (r["accept_rate"], -r["kl"]) > (best["accept"], -best["kl"]):
            best.update(accept=r["accept_rate"], kl=r["kl"], step=step, state=[p.detach().clone() for p in params])
        lens = " ".join(f"k{s} {r[f'accept_len_{s}']:.3f}" for s in range(1, args.chain_k + 1))
        log(f"  eval step {step}: kl {r['kl']:.4f}, acceptance {r['accept_rate']:.4f}; tokens/verify {lens} "
            f"({r['eval_seconds']:.1f}s)")

    t_train = time.time()
    do_eval(0)
    step, calib_t0 = 0, None
    acc_rows = {k: 0.0 for k in ("loss", "kl", "text_ce", "aux", "accept")}
    acc_n = 0
    while total_steps is None or step < total_steps:
        lr = lr_at(step, total_steps, args)
        for grp in opt.param_groups:
            grp["lr"] = lr
        loss, parts = step_loss()
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        gnorm = torch.nn.utils.clip_grad_norm_(masters, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        acc_rows["loss"] += loss.detach()
        for k, v in parts.items():
            acc_rows[k] += v.detach()
        acc_n += 1
        step += 1

        if total_steps is None:
            if step == 3:
                sync()
                calib_t0 = time.time()
            elif step == 3 + args.calib_steps:
                sync()
                dt = (time.time() - calib_t0) / args.calib_steps
                left = args.train_seconds - (time.time() - t_train)
                n_evals = max(1.0, left / dt / args.eval_every)
                eval_cost = evals[0]["eval_seconds"] * n_evals
                total_steps = step + max(0, int((left - eval_cost) / dt))
                log(f"calibration: {dt * 1000:.1f} ms/step, {tokens_per_step / dt:,.0f} block rows/s; "
                    f"total steps {total_steps} ({total_steps * tokens_per_step / train.numel():.2f} epochs)")

        if step % args.log_every == 0 or step == total_steps:
            sync()
            row = {k: (v / acc_n).item() for k, v in acc_rows.items()}
            row.update(step=step, lr=lr, grad_norm=gnorm.item(), time=time.time() - t_train)
            log_rows.append(row)
            acc_rows = {k: 0.0 for k in acc_rows}
            acc_n = 0
            log(f"step {step}/{total_steps} loss {row['loss']:.4f} kl {row['kl']:.4f} aux {row['aux']:.3f} "
                f"accept {row['accept']:.4f} gnorm {row['grad_norm']:.2f} lr {lr:.2e} "
                f"{step * tokens_per_step / row['time']:,.0f} rows/s {row['time']:.0f}s")
            if not math.isfinite(row["loss"]):
                sys.exit("loss is not finite")
        if step % args.eval_every == 0 and step != total_steps:
            do_eval(step)

    sync()
    train_time = time.time() - t_train
    do_eval(step)
    if best["step"] != step:
        log(f"restoring the weights of step {best['step']} (acceptance {best['accept']:.4f} > final "
            f"{evals[-1]['accept_rate']:.4f})")
        with torch.no_grad():
            torch._foreach_copy_(params, best["state"])

    from safetensors.torch import save_file

    os.makedirs(args.out_dir, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in block.hf_state_dict().items()}
    out_file = os.path.join(args.out_dir, "mtp.safetensors")
    save_file(tensors, out_file, metadata={"format": "pt"})
    saved = next(e for e in evals if e["step"] == best["step"])
    summary = {
        "model": os.path.relpath(args.model, REPO) if args.model.startswith(REPO) else args.model,
        "block_params": n_params,
        "config": cfg.to_dict(),
        "args": vars(args),
        "seed": args.seed,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "compute_dtype": str(dtype),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "train_tokens": train.numel(),
        "heldout_windows": n_held,
        "heldout_rows": n_held * args.seq_len,
        "main_heldout_top1": main_acc,
        "steps": step,
        "block_rows_seen": step * tokens_per_step,
        "epochs": step * tokens_per_step / train.numel(),
        "train_seconds": train_time,
        "total_seconds": time.time() - t_start,
        "saved_step": best["step"],
        "saved_eval": saved,
        "log": log_rows,
        "evals": evals,
    }
    if cuda:
        summary["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        log(f"peak GPU memory {summary['peak_gpu_gib']:.1f} GiB")
    with open(os.path.join(args.out_dir, "mtp_log.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    log(f"  {out_file} {os.path.getsize(out_file) / 2**20:.2f} MiB, {len(tensors)} tensors")
    log(f"done: {step} steps, {step * tokens_per_step:,} block rows, {train_time:.0f}s training, "
        f"{time.time() - t_start:.0f}s total; saved step {best['step']}: acceptance {saved['accept_rate']:.4f}, "
        f"tokens/verify k=1..{args.chain_k}: "
        + " ".join(f"{saved[f'accept_len_{s}']:.3f}" for s in range(1, args.chain_k + 1)))


if __name__ == "__main__":
    main()
