"""Command line: python -m lily {generate,chat,serve,info,eval,convert,bench}."""

from __future__ import annotations

import argparse
import sys
import time

from .errors import LilyError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="checkpoint folder, Hugging Face repo id, or 'lily-tiny' (default: the packaged lily-tiny)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="tokens per prefill chunk (default: 4096 on CUDA, 512 elsewhere)")
    p.add_argument("--kv-cache-dtype", choices=("f32", "bf16"), default="f32",
                   help="KV cache precision (bf16 halves its memory; default f32)")
    p.add_argument("--lm-head", choices=("auto", "8bit", "native"), default="auto",
                   help="LM head of a bf16/f16/f32 checkpoint: 8-bit affine quantized at load, as stored, or auto "
                        "(8-bit where the backend's measured default says it is faster; default)")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _sampling(args):
    from .sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed)


def _engine(args):
    from .engine import Engine

    return Engine.from_pretrained(args.model, threads=args.threads, prefill_chunk=args.prefill_chunk,
                                  kv_cache_dtype=args.kv_cache_dtype, lm_head=args.lm_head)


def _prefill_with_bar(session, ids) -> None:
    if len(ids) <= session.prefill_chunk:
        session.prefill(ids)
        return
    from tqdm import tqdm

    with tqdm(total=len(ids), unit="tok", desc="prefill", file=sys.stderr, leave=False) as bar:
        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)

        session.prefill(ids, progress=progress)


def cmd_generate(args) -> int:
    engine = _engine(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    ids = engine.tokenize(prompt)
    if not ids:
        raise LilyError("the prompt is empty")
    session = engine.session(max_context=len(ids) + args.max_tokens)
    t0 = time.perf_counter()
    _prefill_with_bar(session, ids)
    t1 = time.perf_counter()
    n = 0
    sys.stdout.write(prompt if args.echo else "")
    decoder = engine.tokenizer.stream_decoder(skip_special_tokens=True)
    for tok in session.generate(args.max_tokens, _sampling(args)):
        n += 1
        sys.stdout.write(decoder.push(tok))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    t2 = time.perf_counter()
    if args.stats:
        print(f"[prefill {len(ids)} tok in {t1 - t0:.3f}s = {len(ids) / max(t1 - t0, 1e-9):.1f} tok/s; "
              f"decode {n} tok in {t2 - t1:.3f}s = {n / max(t2 - t1, 1e-9):.1f} tok/s; "
              f"stop: {session.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    engine = _engine(args)
    session = engine.session(max_context=args.max_context)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Lily chat: empty line or Ctrl-D to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            session.reset()
            continue
        messages.append({"role": "user", "content": line})
        ids = engine.apply_chat_template(messages)
        done = session.tokens
        if ids[: len(done)] == done and len(ids) > len(done):
            new = ids[len(done):]  # the conversation so far is already in the session: feed only the turn
        else:
            session.reset()
            new = ids
        if len(new) + session.position + args.max_tokens > session.max_context:
            print("[context full: starting over with this message]", file=sys.stderr)
            messages = messages[-1:]
            session.reset()
            new = engine.apply_chat_template(messages)
        _prefill_with_bar(session, new)
        reply = []
        for piece in session.generate_text(args.max_tokens, _sampling(args)):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_serve(args) -> int:
    try:
        from .server import ServerConfig, serve
    except ImportError as exc:
        raise LilyError(str(exc)) from None
    import pathlib

    engine = _engine(args)
    template = None
    if args.chat_template is not None:
        template = pathlib.Path(args.chat_template).read_text(encoding="utf-8")
    # Clients send the id they were told: a repo id as given, a local folder by its name.
    model = str(args.model) if args.model else "lily-tiny"
    name = args.served_model_name or (pathlib.Path(model).name if pathlib.Path(model).is_dir() else model)
    config = ServerConfig(model_name=name, max_context=args.max_context, max_concurrency=args.max_concurrency,
                          max_queue=args.max_queue, request_timeout=args.request_timeout,
                          default_max_tokens=args.default_max_tokens, chat_template=template,
                          prefix_cache_bytes=args.prefix_cache_bytes, prefix_cache_dir=args.prefix_cache_dir,
                          prefix_cache_disk_bytes=args.prefix_cache_disk_bytes,
                          prefix_cache_interval=args.prefix_cache_interval, keep_sessions=args.keep_sessions)
    for field in ("max_context", "max_concurrency", "default_max_tokens"):
        if getattr(config, field) < 1:
            raise LilyError(f"--{field.replace('_', '-')} must be >= 1")
    for field in ("max_queue", "prefix_cache_bytes", "prefix_cache_disk_bytes", "prefix_cache_interval",
                  "keep_sessions"):
        if getattr(config, field) < 0:
            raise LilyError(f"--{field.replace('_', '-')} must be >= 0")
    if not config.request_timeout > 0:
        raise LilyError("--request-timeout must be > 0")
    print(f"Lily serving '{name}' on http://{args.host}:{args.port}/v1 ({engine.backend})", file=sys.stderr)
    serve(engine, host=args.host, port=args.port, config=config, log_level=args.log_level)
    return 0


def cmd_info(args) -> int:
    engine = _engine(args)
    print(engine.report())
    return 0


def cmd_convert(args) -> int:
    from .convert import convert

    convert(args.src, args.dst, group_size=args.group_size, bits=args.bits, progress=True, mtp=args.mtp)
    print(f"wrote {args.dst}")
    return 0


def cmd_eval(args) -> int:
    import pathlib

    from .evaluate import evaluate, format_table, save_json

    engine = _engine(args)
    text_path = args.text
    if text_path is None:
        bundled = pathlib.Path(engine.checkpoint.path) / "heldout.txt"
        if not bundled.is_file():
            raise LilyError("--text is required: this checkpoint ships no held-out text")
        text_path = bundled
    text = pathlib.Path(text_path).read_text(encoding="utf-8")
    result = evaluate(engine, text, positions=args.positions, references=args.reference)
    print(format_table(result))
    if args.json:
        save_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lily", description="Lily: local Qwen3.6 inference")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt, streaming the text")
    g.add_argument("prompt", nargs="?", default=None, help="prompt text (default: read stdin)")
    _add_model_args(g)
    _add_sampling_args(g, 128)
    g.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    g.add_argument("--stats", action="store_true", help="print prefill/decode speed to stderr")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the checkpoint's chat template")
    _add_model_args(c)
    _add_sampling_args(c, 512)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-context", type=int, default=8192)
    c.set_defaults(fn=cmd_chat)

    s = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server (the [server] extra)")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: --model as given, a local folder by its name)")
    s.add_argument("--max-context", type=int, default=32768, help="tokens per request, prompt plus completion")
    s.add_argument("--max-concurrency", type=int, default=4, help="generations running at once")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request before 503")
    s.add_argument("--default-max-tokens", type=int, default=4096, help="when a request gives no max_tokens")
    s.add_argument("--chat-template", default=None, help="a Jinja chat template file to use instead of the model's")
    s.add_argument("--prefix-cache-bytes", type=int, default=1 << 30,
                   help="budget of the prefix cache's checkpoints in memory (default 1 GiB; 0 turns it off)")
    s.add_argument("--prefix-cache-dir", default=None,
                   help="folder for the prefix cache's disk tier: evicted checkpoints spill there and a restarted "
                        "server finds them (default: no disk tier)")
    s.add_argument("--prefix-cache-disk-bytes", type=int, default=4 << 30,
                   help="budget of the files in --prefix-cache-dir (default 4 GiB)")
    s.add_argument("--prefix-cache-interval", type=int, default=4096,
                   help="also checkpoint every this many tokens of a long prompt (default 4096; 0: off)")
    s.add_argument("--keep-sessions", type=int, default=2,
                   help="closed requests' session states kept for the next request, so a warm turn restores into "
                        "one already holding its KV rows (default 2; 0: the engine's own setting)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.set_defaults(fn=cmd_serve)

    i = sub.add_parser("info", help="print the engine report (backend, memory, kernels, optimizations)")
    _add_model_args(i)
    i.set_defaults(fn=cmd_info)

    e = sub.add_parser("eval", help="teacher-forced comparison with transformers / mlx-lm on the same weights")
    _add_model_args(e)
    e.add_argument("--text", default=None, help="held-out text file (default: the one shipped with the model)")
    e.add_argument("--positions", type=int, default=192)
    e.add_argument("--reference", nargs="+", default=["transformers"], choices=("transformers", "mlx"))
    e.add_argument("--json", default=None, help="also write the results as JSON")
    e.set_defaults(fn=cmd_eval)

    v = sub.add_parser("convert", help="Hugging Face bf16 checkpoint -> MLX 4-bit (8-bit router) format")
    v.add_argument("src")
    v.add_argument("dst")
    v.add_argument("--bits", type=int, default=4, choices=(4, 8))
    v.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    v.add_argument("--no-mtp", dest="mtp", action="store_false",
                   help="drop the MTP block, as mlx-lm does (default: keep it as language_model.mtp.*)")
    v.set_defaults(fn=cmd_convert)

    from . import bench

    b = sub.add_parser("bench", help="prefill and decode throughput sweep (256 .. --max-length tokens)",
                       description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(b)
    b.set_defaults(fn=bench.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (LilyError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
