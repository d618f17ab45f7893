"""OpenAI- and Anthropic-compatible HTTP server: ``python -m lily serve`` (the ``lily-inference[server]`` extra).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/messages`` (Anthropic),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (JSON, or Prometheus text with
``?format=prometheus`` or ``Accept: text/plain``).

Scheduling: every request gets its own :class:`lily.Session` (sized for its prompt and max_tokens, rounded up
to a power of two so a conversation's turns can reuse the engine's kept session states: ``keep_sessions``) driven
by its own worker thread; the engine lock serialises forwards, so concurrent generations interleave step
by step. At most ``max_concurrency`` generations run at once; up to ``max_queue`` more wait for a slot,
and a request beyond that is answered 429 at once. A request that is not finished ``request_timeout``
seconds after it arrived is answered 503 (waiting or generating; a stream gets an error event). A client
that disconnects has its generation stopped after the current decode step and its session closed.

Prefix cache (``prefix_cache_bytes``): see :mod:`lily.prefix_cache`; ``usage`` reports the prompt tokens
it supplied (``prompt_tokens_details.cached_tokens``; Anthropic's ``cache_read_input_tokens``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Lily server needs FastAPI and uvicorn: pip install 'lily-inference[server]' "
                      f"({exc})") from exc

from .chat import render_chat
from .errors import ChatTemplateError, LilyError
from .outputs import THINK_OPEN, OutputParser, ToolCall
from .sampling import SamplingParams
from .streaming import GenerationResponse

__all__ = ["ServerConfig", "LilyServer", "ServerThread", "create_app", "serve"]


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered with an OpenAI-style body (Anthropic-style on /v1/messages)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 404: "invalid_request_error",
                             413: "invalid_request_error", 429: "rate_limit_error",
                             503: "overloaded_error"}.get(status, "server_error")

    def openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic(self) -> dict:
        kind = {"invalid_request_error": "invalid_request_error", "rate_limit_error": "rate_limit_error",
                "overloaded_error": "overloaded_error"}.get(self.type, "api_error")
        if self.status == 404:
            kind = "not_found_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def _bad(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ------------------------------------------------------------------------------------------------
# request fields
# ------------------------------------------------------------------------------------------------

_MISSING = object()


class Fields:
    """Typed reads of a JSON request body; every error names the field."""

    def __init__(self, body: Any, where: str):
        if not isinstance(body, dict):
            raise _bad(f"{where}: the request body must be a JSON object, got {type(body).__name__}", None)
        self.body = body
        self.where = where
        self.request: Request | None = None  # the HTTP request it came with

    def _err(self, name: str, what: str, value: Any) -> APIError:
        shown = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
        return _bad(f"{self.where}: '{name}' must be {what}, got {shown}", name)

    def get(self, name: str, default: Any = None) -> Any:
        v = self.body.get(name, _MISSING)
        return default if v is _MISSING or v is None else v

    def number(self, name: str, default: float | None, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> float | None:
        v = self.get(name, _MISSING)
        if v is _MISSING:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self._err(name, "a finite number", v)
        bounds = f"in {'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else (
            f"> {lo}" if lo_open else f">= {lo}")
        if lo is not None and (v < lo or (lo_open and v == lo)):
            raise self._err(name, f"a number {bounds}", v)
        if hi is not None and v > hi:
            raise self._err(name, f"a number {bounds}", v)
        return float(v)

    def integer(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self.get(name, _MISSING)
        if v is _MISSING:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._err(name, "an integer", v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise self._err(name, f"an integer {rng}", v)
        return v

    def boolean(self, name: str, default: bool) -> bool:
        v = self.get(name, _MISSING)
        if v is _MISSING:
            return default
        if not isinstance(v, bool):
            raise self._err(name, "true or false", v)
        return v

    def string(self, name: str, default: str | None = None) -> str | None:
        v = self.get(name, _MISSING)
        if v is _MISSING:
            return default
        if not isinstance(v, str):
            raise self._err(name, "a string", v)
        return v

    def obj(self, name: str) -> dict | None:
        v = self.get(name, _MISSING)
        if v is _MISSING:
            return None
        if not isinstance(v, dict):
            raise self._err(name, "an object", v)
        return v

    def stops(self, name: str) -> tuple[str, ...]:
        v = self.get(name, _MISSING)
        if v is _MISSING:
            return ()
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise self._err(name, "a string or a list of strings", v)
        if any(not s for s in items):
            raise self._err(name, "non-empty strings", v)
        return tuple(dict.fromkeys(items))


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _sampling(f: Fields, *, temperature_default: float = 1.0) -> SamplingParams:
    """OpenAI sampling fields (plus the vLLM-style top_k / min_p / repetition_penalty) as SamplingParams."""
    top_k = f.integer("top_k", 0, lo=-1)
    kwargs = dict(
        temperature=f.number("temperature", temperature_default, lo=0.0),
        top_p=f.number("top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=0 if top_k in (-1, 0) else top_k,  # -1 is vLLM's "off"
        min_p=f.number("min_p", 0.0, lo=0.0, hi=1.0),
        repetition_penalty=f.number("repetition_penalty", 1.0, lo=0.0, lo_open=True),
        presence_penalty=f.number("presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        seed=f.integer("seed", None, lo=0, hi=2**64 - 1),
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # "SamplingParams.<field> must ..." names the field
        name = str(exc).split(" ", 1)[0].split(".")[-1]
        raise _bad(f"{f.where}: {exc}", name if name in kwargs else None) from None


# ------------------------------------------------------------------------------------------------
# configuration and metrics
# ------------------------------------------------------------------------------------------------

@dataclass
class ServerConfig:
    model_name: str = "lily-tiny"
    max_context: int = 32768  # per request: prompt + generated tokens (each session's KV cache is this big at most)
    max_concurrency: int = 4  # generations running at once
    max_queue: int = 64  # requests waiting for a slot; one more is answered 429
    request_timeout: float = 600.0  # seconds from arrival to the last token; then 503
    default_max_tokens: int = 4096  # when a request gives none (capped by the room left in max_context)
    chat_template: str | None = None  # overrides the checkpoint's chat template
    prefix_cache_bytes: int = 1 << 30  # budget of the prefix cache's checkpoints in memory (see lily.prefix_cache); 0: off
    prefix_cache_dir: str | None = None  # the disk tier: evicted checkpoints spill here (a restarted server finds them)
    prefix_cache_disk_bytes: int = 4 << 30  # budget of the files in prefix_cache_dir
    prefix_cache_interval: int = 4096  # also checkpoint every this many tokens of a long prefill; 0: off
    # Closed requests' session state the engine keeps for the next request (Engine.keep_sessions): a warm turn
    # restores into a kept state that already holds the conversation's KV rows instead of copying them into
    # fresh pages. Raised on the engine to this if it keeps fewer; 0 leaves the engine as it is.
    keep_sessions: int = 2


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        from .streaming import peak_rss_bytes
        return peak_rss_bytes()


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.rejected = 0
        self.timed_out = 0
        self.cancelled = 0
        self.started = time.time()

    def count(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def tokens(self, prompt: int, completion: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def bump(self, name: str) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)


# ------------------------------------------------------------------------------------------------
# generation jobs
# ------------------------------------------------------------------------------------------------

@dataclass
class GenRequest:
    """What one request asks the engine for (already validated)."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    logprobs: int = 0  # top alternatives to report per token; -1: only the token's own logprob
    ignore_eos: bool = False
    checkpoints: tuple[int, ...] = ()  # prompt positions worth a prefix-cache checkpoint


@dataclass
class Job:
    req: GenRequest
    deadline: float
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    tokens: list[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens restored from the prefix cache


@dataclass
class Finish:
    reason: str  # "stop" | "length" | "context" | "timeout" | "cancelled"
    completion_tokens: int
    stop_sequence: str | None = None  # the stop string that ended it
    eos: bool = False  # ended on a stop token
    cached: int = 0  # prompt tokens restored from the prefix cache


_DISCONNECT_POLL = 0.25  # seconds between checks that a non-streaming request's client is still there


class LilyServer:
    """The engine behind the HTTP endpoints: admission, one worker thread and Session per request."""

    def __init__(self, engine, config: ServerConfig | None = None):
        self.engine = engine
        self.config = config or ServerConfig()
        if engine.tokenizer is None:
            raise LilyError("the server needs a checkpoint with a tokenizer (tokenizer.json)")
        self.metrics = Metrics()
        from .prefix_cache import PrefixCache

        c = self.config
        self.cache = (PrefixCache(engine, c.prefix_cache_bytes, disk_dir=c.prefix_cache_dir,
                                  disk_bytes=c.prefix_cache_disk_bytes, checkpoint_interval=c.prefix_cache_interval)
                      if c.prefix_cache_bytes else None)
        if c.keep_sessions > engine.keep_sessions:
            engine.keep_sessions = c.keep_sessions
        self.active = 0
        self.waiting = 0
        self._slots: asyncio.Semaphore | None = None
        self._token_text: dict[int, str] = {}

    # ---- the one place tokens come from (tests substitute it to script the model's output) ----
    def _token_stream(self, session, req: GenRequest) -> Iterator[GenerationResponse]:
        return session.stream(req.max_tokens, req.sampling, stop=req.stop or None,
                              stop_token_ids=[] if req.ignore_eos else None,
                              logprobs=max(req.logprobs, 1) if req.logprobs else 0)

    def token_text(self, tok: int) -> str:
        s = self._token_text.get(tok)
        if s is None:
            s = self._token_text[tok] = self.engine.tokenizer.decode([tok])
        return s

    def session_context(self, need: int) -> int:
        """A request's session size: prompt + max_tokens rounded up to a power of two (at most max_context), so
        the turns of a conversation ask for the same shape and restore into a kept session state (only a state
        of the same max_context is reused). On the CPU backend the KV cache's pages become resident only as rows
        are written, so the rounding costs address space; a GPU backend allocates the rounded size (under 2x the
        request's KV rows)."""
        return min(self.config.max_context, 1 << max(0, need - 1).bit_length())

    # ---- prompts ----
    def render(self, messages: list[dict], tools: list[dict] | None, kwargs: dict,
               add_generation_prompt: bool = True) -> str:
        tok = self.engine.tokenizer
        template = self.config.chat_template or tok.get_chat_template(tools)
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           **{**tok.special_tokens_map(), **kwargs})

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str, where: str) -> int:
        """The max_tokens to use; 400 when the prompt (plus an explicit max_tokens) does not fit."""
        limit = self.config.max_context
        if not ids:
            raise _bad(f"{where}: the prompt is empty", param)
        if len(ids) >= limit:
            raise APIError(400, f"{where}: the prompt is {len(ids)} tokens; this server's context is {limit} "
                           "tokens (prompt plus completion)", param=param, code="context_length_exceeded")
        room = limit - len(ids)
        if max_tokens is None:
            return min(room, self.config.default_max_tokens)
        if max_tokens > room:
            raise APIError(400, f"{where}: the prompt is {len(ids)} tokens and 'max_tokens' is {max_tokens}: more "
                           f"than this server's context of {limit} tokens", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    # ---- admission ----
    async def submit(self, req: GenRequest, arrived: float) -> Job:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrency)
        if self._slots.locked() and self.waiting >= self.config.max_queue:
            self.metrics.bump("rejected")
            raise APIError(429, f"the server is busy: {self.active} requests running and {self.waiting} "
                           f"waiting (max_queue={self.config.max_queue}); retry later", code="queue_full")
        deadline = arrived + self.config.request_timeout
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.metrics.bump("timed_out")
            raise APIError(503, f"the request waited {self.config.request_timeout:g} s (request_timeout) for a "
                           "free slot", code="timeout") from None
        finally:
            self.waiting -= 1
        self.active += 1
        job = Job(req=req, deadline=deadline, loop=asyncio.get_running_loop())
        threading.Thread(target=self._work, args=(job,), name="lily-server-request", daemon=True).start()
        return job

    def _release(self) -> None:
        self.active -= 1
        assert self._slots is not None
        self._slots.release()

    def _post(self, job: Job, item: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(job.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            pass

    def _work(self, job: Job) -> None:
        """Runs on the request's own thread: prefill, then one token at a time until done or cancelled."""
        req, session, finish = job.req, None, None
        try:
            session = self.engine.session(max_context=self.session_context(len(req.ids) + req.max_tokens))

            def progress(done: int, total: int) -> bool:
                return not job.cancel.is_set() and time.monotonic() < job.deadline

            if self.cache is not None:
                job.cached = self.cache.prefill(session, req.ids, checkpoints=req.checkpoints, progress=progress)
            else:
                session.prefill(req.ids, progress=progress if len(req.ids) > session.prefill_chunk else None)
            reason = None
            if job.cancel.is_set():
                reason = "cancelled"
            elif time.monotonic() >= job.deadline:
                reason = "timeout"
            else:
                stream = self._token_stream(session, req)
                try:
                    for r in stream:
                        job.tokens.append(r.token)
                        self._post(job, r)
                        if r.finish_reason is not None:
                            reason = r.finish_reason
                        # Checked after every token: a disconnect stops the loop within one decode step.
                        if job.cancel.is_set():
                            reason = "cancelled"
                            break
                        if time.monotonic() >= job.deadline:
                            reason = "timeout"
                            break
                finally:
                    stream.close()  # the C++ loop stops after the current token
                if reason is None:
                    reason = session.finish_reason or "stop"
                if self.cache is not None and reason in ("stop", "length"):
                    # The prompt plus the reply: the next turn hits it when it re-renders the reply unchanged.
                    self.cache.store(session, req.ids + job.tokens)
            finish = self._finish(job, reason)
        except BaseException as exc:  # reported to the request; the server goes on
            finish = exc
        finally:
            if session is not None:
                try:
                    session.close()  # frees the KV cache and recurrent state now, not at garbage collection
                except Exception:
                    pass
            if isinstance(finish, Finish):
                self.metrics.tokens(len(req.ids), finish.completion_tokens)
                if finish.reason == "cancelled":
                    self.metrics.bump("cancelled")
                elif finish.reason == "timeout":
                    self.metrics.bump("timed_out")
            self._post(job, finish)
            try:
                job.loop.call_soon_threadsafe(self._release)
            except RuntimeError:
                pass

    def _finish(self, job: Job, reason: str) -> Finish:
        stops = set(self.engine.stop_token_ids) if not job.req.ignore_eos else set()
        eos = reason == "stop" and bool(job.tokens) and job.tokens[-1] in stops
        matched = None
        if reason == "stop" and not eos and job.req.stop:
            text = self.engine.tokenizer.decode(job.tokens, skip_special_tokens=True)
            hits = [(text.find(s), s) for s in job.req.stop if s in text]
            matched = min(hits)[1] if hits else None
        return Finish(reason, len(job.tokens), matched, eos, job.cached)

    async def events(self, job: Job, request: Request | None = None) -> AsyncIterator[GenerationResponse | Finish]:
        """The job's responses then its Finish; raises APIError on a timeout or failure. Leaving early
        (a disconnect, an exception) cancels the generation. With ``request`` (a response that is sent only
        at the end), the client's connection is checked every quarter second: nobody else would notice
        that it has gone."""
        next_check = time.monotonic() + _DISCONNECT_POLL
        try:
            while True:
                now = time.monotonic()
                if request is not None and now >= next_check:
                    next_check = now + _DISCONNECT_POLL
                    if await request.is_disconnected():
                        raise APIError(499, "the client disconnected", code="client_disconnected")
                remaining = job.deadline - now
                wait = max(remaining, 0.0) + 1.0
                if request is not None:
                    wait = min(wait, max(next_check - now, 0.0))
                try:
                    item = await asyncio.wait_for(job.queue.get(), timeout=wait)
                except asyncio.TimeoutError:
                    if time.monotonic() < job.deadline + 1.0:
                        continue  # a disconnect check is due
                    job.cancel.set()
                    raise APIError(503, f"the request did not finish within request_timeout="
                                   f"{self.config.request_timeout:g} s", code="timeout") from None
                if isinstance(item, Finish):
                    if item.reason == "timeout":
                        raise APIError(503, f"the request did not finish within request_timeout="
                                       f"{self.config.request_timeout:g} s", code="timeout")
                    yield item
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, (ValueError, LilyError)):
                        raise APIError(503 if "allocate" in str(item) else 400, str(item))
                    raise APIError(500, f"generation failed: {type(item).__name__}: {item}")
                yield item
        finally:
            job.cancel.set()  # no-op when finished; otherwise the worker stops after the current token

    # ---- logprobs ----
    def logprob_entry(self, r: GenerationResponse, k: int) -> dict:
        def entry(tok: int, lp: float) -> dict:
            s = self.token_text(tok)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        out = entry(r.token, r.logprob if r.logprob is not None else 0.0)
        out["top_logprobs"] = [entry(t, lp) for t, lp in r.top_logprobs[:max(k, 0)]]
        return out


# ------------------------------------------------------------------------------------------------
# request parsing shared by the chat endpoints
# ------------------------------------------------------------------------------------------------

def _check_model(server: LilyServer, f: Fields) -> None:
    model = f.get("model", _MISSING)
    if model is _MISSING:
        raise _bad(f"{f.where}: 'model' is required", "model")
    if not isinstance(model, str):
        raise f._err("model", "a string", model)
    if model != server.config.model_name:
        raise APIError(404, f"{f.where}: the model '{model[:100]}' does not exist; this server serves "
                       f"'{server.config.model_name}'", param="model", code="model_not_found")


def _text_content(content: Any, where: str, label: str) -> str:
    param = label.split("[")[0].split(".")[0]  # the top-level field: "messages[2].content" is in 'messages'
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"{where}: {label}[{j}] must be a text part ({{'type': 'text', 'text': ...}}); "
                           f"got {str(kind)[:40]!r}: this server takes text only", param)
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}: {label} must be a string or a list of text parts", param)


def _tool_arguments(args: Any) -> Any:
    # Qwen3.6's template iterates arguments as a mapping; OpenAI clients send them as a JSON string.
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return args
        return parsed if isinstance(parsed, dict) else args
    return args


def _openai_tools(f: Fields) -> list[dict] | None:
    tools = f.get("tools", _MISSING)
    if tools is _MISSING:
        return None
    if not isinstance(tools, list):
        raise f._err("tools", "a list of tool definitions", tools)
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{f.where}: tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                       "'parameters': {...}}}", "tools")
        out.append({"type": "function", "function": fn})
    return out or None


def _template_kwargs(f: Fields) -> dict:
    kw = f.obj("chat_template_kwargs") or {}
    reserved = {"messages", "tools", "add_generation_prompt"} & set(kw)
    if reserved:
        raise _bad(f"{f.where}: chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
    if "enable_thinking" in kw and not isinstance(kw["enable_thinking"], bool):
        raise _bad(f"{f.where}: chat_template_kwargs.enable_thinking must be true or false",
                   "chat_template_kwargs")
    return dict(kw)


def _no_constrained_decoding(f: Fields) -> None:
    fmt = f.get("response_format", _MISSING)
    if fmt is not _MISSING:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind != "text":
            raise _bad(f"{f.where}: response_format {json.dumps(kind)[:40]} is not supported: constrained "
                       "decoding needs a logits mask in the sampler, which Lily does not have yet",
                       "response_format", code="unsupported")


async def _prepare(server: LilyServer, messages: list[dict], tools: list[dict] | None, kwargs: dict,
                   where: str) -> tuple[list[int], bool, tuple[int, ...]]:
    """Token ids of the rendered conversation, whether the output starts inside <think>, and the prompt
    positions worth a prefix-cache checkpoint."""
    def work():
        text = server.render(messages, tools, kwargs)
        ids = server.engine.tokenizer.encode(text)
        cuts: tuple[int, ...] = ()
        if server.cache is not None:
            # Where the conversation ends without the generation prompt: the next turn's prompt shares
            # this much even when the template re-renders this turn's reply differently (without its
            # reasoning, as Qwen3.6's does).
            base = server.engine.tokenizer.encode(server.render(messages, tools, kwargs, add_generation_prompt=False))
            if 0 < len(base) < len(ids) and ids[:len(base)] == base:
                cuts = (len(base),)
        return text, ids, cuts

    try:
        text, ids, cuts = await asyncio.to_thread(work)  # a template may take up to its render budget
    except (ChatTemplateError, ValueError) as exc:
        raise _bad(f"{where}: {exc}", "messages") from None
    return ids, text.rstrip().endswith(THINK_OPEN), cuts


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------------------------
# OpenAI: chat completions
# ------------------------------------------------------------------------------------------------

_OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")


def _openai_messages(f: Fields) -> list[dict]:
    msgs = f.get("messages", _MISSING)
    if not isinstance(msgs, list) or not msgs:
        raise _bad(f"{f.where}: 'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _OPENAI_ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise _bad(f"{f.where}: {where}.role must be one of {list(_OPENAI_ROLES)}, got {json.dumps(role)[:40]}",
                       "messages")
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"]}
        content = m.get("content")
        if content is not None:
            msg["content"] = _text_content(content, f.where, f"{where}.content")
        for key in ("name", "tool_call_id", "reasoning_content"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                      for c in calls):
                raise _bad(f"{f.where}: {where}.tool_calls must be a list of {{'function': {{...}}}}", "messages")
            msg["tool_calls"] = [{**c, "function": {**c["function"],
                                                    "arguments": _tool_arguments(c["function"].get("arguments", {}))}}
                                 for c in calls]
        if "content" not in msg:
            if not calls:
                raise _bad(f"{f.where}: {where}.content is missing", "messages")
            msg["content"] = ""
        out.append(msg)
    return out


@dataclass
class ChatJob:
    req: GenRequest
    in_reasoning: bool
    tools: list[dict] | None
    top_logprobs: int
    want_logprobs: bool


async def _parse_chat(server: LilyServer, f: Fields) -> ChatJob:
    _check_model(server, f)
    n = f.integer("n", 1)
    if n != 1:
        raise _bad(f"{f.where}: 'n' must be 1 (this server generates one choice per request), got {n}", "n")
    _no_constrained_decoding(f)
    messages = _openai_messages(f)
    tools = _openai_tools(f)
    choice = f.get("tool_choice", "auto")
    if choice == "none":
        tools = None
    elif choice != "auto":
        raise _bad(f"{f.where}: tool_choice {json.dumps(choice)[:60]} is not supported (only 'auto' and 'none'): "
                   "forcing a call needs constrained decoding", "tool_choice", code="unsupported")
    sampling = _sampling(f)
    want = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", 0, lo=0, hi=20)
    if top and not want:
        raise _bad(f"{f.where}: 'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens = f.integer("max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = f.integer("max_tokens", None, lo=1)
    stop = f.stops("stop")
    ignore_eos = f.boolean("ignore_eos", False)
    kwargs = _template_kwargs(f)
    ids, in_reasoning, cuts = await _prepare(server, messages, tools, kwargs, f.where)
    max_tokens = server.check_prompt(ids, max_tokens, "messages", f.where)
    req = GenRequest(ids, max_tokens, sampling, stop, (top or -1) if want else 0, ignore_eos, cuts)
    return ChatJob(req, in_reasoning, tools, top, want)


def _finish_reason(fin: Finish, tool_calls: int) -> str:
    if tool_calls and fin.reason == "stop":
        return "tool_calls"
    return "stop" if fin.reason in ("stop", "cancelled") else "length"


def _usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _openai_tool_call(call: ToolCall, index: int) -> dict:
    return {"index": index, "id": _new_id("call_"), "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


async def chat_completions(server: LilyServer, f: Fields, arrived: float):
    cj = await _parse_chat(server, f)
    stream = f.boolean("stream", False)
    opts = f.obj("stream_options") or {}
    include_usage = bool(opts.get("include_usage", False))
    job = await server.submit(cj.req, arrived)
    # A stream announces a call and sends its arguments while the model writes them.
    parser = OutputParser(in_reasoning=cj.in_reasoning, tools=cj.tools, stream_arguments=stream)
    rid, created, model = _new_id("chatcmpl-"), int(time.time()), server.config.model_name
    prompt_n = len(cj.req.ids)

    if not stream:
        text, reasoning, calls, lps = [], [], [], []
        fin = None
        async for item in server.events(job, f.request):
            if isinstance(item, Finish):
                fin = item
                break
            if cj.want_logprobs:
                lps.append(server.logprob_entry(item, cj.top_logprobs))
            _collect(parser.feed(item.text), text, reasoning, calls)
        _collect(parser.finish(), text, reasoning, calls)
        assert fin is not None
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None,
                                   "reasoning_content": "".join(reasoning) or None}
        if calls:
            message["tool_calls"] = [{k: v for k, v in _openai_tool_call(c, i).items() if k != "index"}
                                     for i, c in enumerate(calls)]
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": {"content": lps} if cj.want_logprobs else None,
                         "finish_reason": _finish_reason(fin, len(calls))}],
            "usage": _usage(prompt_n, fin.completion_tokens, fin.cached),
        })

    def chunk(delta: dict, finish: str | None = None, logprobs: list | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                  "finish_reason": finish}
        data = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
        if include_usage:
            data["usage"] = None
        return _sse(data)

    calls_sent = [0]
    announced = [False]  # the current call's name and id have gone out (tool_call_begin)

    def deltas(events: list) -> list[dict]:
        out = []
        for kind, value in events:
            if kind == "text":
                out.append({"content": value})
            elif kind == "reasoning":
                out.append({"reasoning_content": value})
            elif kind == "tool_call_begin":  # the name and id first; arguments follow in pieces
                out.append({"tool_calls": [{"index": value[0], "id": _new_id("call_"), "type": "function",
                                            "function": {"name": value[1], "arguments": ""}}]})
                announced[0] = True
            elif kind == "tool_call_args":
                out.append({"tool_calls": [{"index": value[0], "function": {"arguments": value[1]}}]})
            elif announced[0]:  # the end of an announced call: everything has been sent
                announced[0] = False
                calls_sent[0] += 1
            else:  # a whole call in one delta (the JSON form is decided only when its block closes)
                out.append({"tool_calls": [_openai_tool_call(value, calls_sent[0])]})
                calls_sent[0] += 1
        return out

    async def body() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        try:
            fin = None
            async for item in server.events(job):
                if isinstance(item, Finish):
                    fin = item
                    break
                lp = [server.logprob_entry(item, cj.top_logprobs)] if cj.want_logprobs else None
                ds = deltas(parser.feed(item.text))
                if not ds and lp:
                    ds = [{}]
                for i, d in enumerate(ds):
                    yield chunk(d, logprobs=lp if i == 0 else None)
            for d in deltas(parser.finish()):
                yield chunk(d)
            assert fin is not None
            yield chunk({}, _finish_reason(fin, parser.tool_calls))
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(prompt_n, fin.completion_tokens, fin.cached)})
        except APIError as exc:
            yield _sse(exc.openai())
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _collect(events: list, text: list, reasoning: list, calls: list) -> None:
    for kind, value in events:
        (text if kind == "text" else reasoning if kind == "reasoning" else calls).append(value)


# ------------------------------------------------------------------------------------------------
# OpenAI: completions
# ------------------------------------------------------------------------------------------------

async def completions(server: LilyServer, f: Fields, arrived: float):
    _check_model(server, f)
    n = f.integer("n", 1)
    if n != 1:
        raise _bad(f"{f.where}: 'n' must be 1 (this server generates one choice per request), got {n}", "n")
    if f.integer("best_of", 1) != 1:
        raise _bad(f"{f.where}: 'best_of' must be 1", "best_of")
    if f.boolean("echo", False):
        raise _bad(f"{f.where}: 'echo' is not supported", "echo", code="unsupported")
    if f.get("suffix") is not None:
        raise _bad(f"{f.where}: 'suffix' is not supported", "suffix", code="unsupported")
    prompt = f.get("prompt", _MISSING)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    vocab = server.engine.config.vocab_size
    if isinstance(prompt, str):
        ids = await asyncio.to_thread(server.engine.tokenizer.encode, prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < vocab for t in prompt):
            raise _bad(f"{f.where}: 'prompt' holds a token id outside the vocabulary [0, {vocab})", "prompt")
        ids = list(prompt)
    else:
        raise _bad(f"{f.where}: 'prompt' must be a string, a list of token ids, or a list of one of those",
                   "prompt")
    sampling = _sampling(f)
    k = f.integer("logprobs", None, lo=0, hi=20)
    max_tokens = server.check_prompt(ids, f.integer("max_tokens", None, lo=1), "prompt", f.where)
    req = GenRequest(ids, max_tokens, sampling, f.stops("stop"), (k or -1) if k is not None else 0,
                     f.boolean("ignore_eos", False))
    stream = f.boolean("stream", False)
    include_usage = bool((f.obj("stream_options") or {}).get("include_usage", False))
    job = await server.submit(req, arrived)
    rid, created, model = _new_id("cmpl-"), int(time.time()), server.config.model_name

    def logprobs_of(rs: list[GenerationResponse], offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for r in rs:
            s = server.token_text(r.token)
            tokens.append(s)
            lps.append(r.logprob)
            tops.append({server.token_text(t): lp for t, lp in r.top_logprobs[:k or 0]})
            offsets.append(offset)
            offset += len(r.text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    if not stream:
        rs, fin = [], None
        async for item in server.events(job, f.request):
            if isinstance(item, Finish):
                fin = item
                break
            rs.append(item)
        assert fin is not None
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": "".join(r.text for r in rs),
                         "logprobs": logprobs_of(rs, 0) if k is not None else None,
                         "finish_reason": _finish_reason(fin, 0)}],
            "usage": _usage(len(ids), fin.completion_tokens, fin.cached),
        })

    def chunk(text: str, finish: str | None, lp: dict | None) -> str:
        data = {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}
        if include_usage:
            data["usage"] = None
        return _sse(data)

    async def body() -> AsyncIterator[str]:
        offset = 0
        try:
            fin = None
            async for item in server.events(job):
                if isinstance(item, Finish):
                    fin = item
                    break
                lp = logprobs_of([item], offset) if k is not None else None
                offset += len(item.text)
                if item.text or lp:
                    yield chunk(item.text, None, lp)
            assert fin is not None
            yield chunk("", _finish_reason(fin, 0), None)
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(len(ids), fin.completion_tokens, fin.cached)})
        except APIError as exc:
            yield _sse(exc.openai())
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


# ------------------------------------------------------------------------------------------------
# Anthropic: messages
# ------------------------------------------------------------------------------------------------

def _anthropic_messages(f: Fields) -> list[dict]:
    out: list[dict] = []
    system = f.get("system", _MISSING)
    if system is not _MISSING:
        out.append({"role": "system", "content": _text_content(system, f.where, "system")})
    msgs = f.get("messages", _MISSING)
    if not isinstance(msgs, list) or not msgs:
        raise _bad(f"{f.where}: 'messages' must be a non-empty list of messages", "messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            role = m.get("role") if isinstance(m, dict) else None
            raise _bad(f"{f.where}: {where}.role must be 'user' or 'assistant', got {json.dumps(role)[:40]}",
                       "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{f.where}: {where}.content must be a string or a list of content blocks", "messages")
        text, reasoning, calls = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            bw = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "thinking" and m["role"] == "assistant" and isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
            elif kind == "redacted_thinking" and m["role"] == "assistant":
                continue  # nothing readable to re-render
            elif kind == "tool_use" and m["role"] == "assistant" and isinstance(block.get("name"), str):
                calls.append({"id": block.get("id", ""), "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and m["role"] == "user":
                if text:  # keep the order: text before the result stays before it
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = block.get("content", "")
                body = result if isinstance(result, str) else _text_content(result, f.where, f"{bw}.content")
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": body})
            else:
                raise _bad(f"{f.where}: {bw} of type {json.dumps(kind)[:40]} is not supported in a "
                           f"{m['role']} message (text, thinking, tool_use and tool_result are)", "messages")
        if m["role"] == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text:
            out.append({"role": "user", "content": "".join(text)})
    return out


def _anthropic_tools(f: Fields) -> list[dict] | None:
    tools = f.get("tools", _MISSING)
    if tools is _MISSING:
        return None
    if not isinstance(tools, list):
        raise f._err("tools", "a list of tools", tools)
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"{f.where}: tools[{i}] must be {{'name': ..., 'input_schema': {{...}}}}", "tools")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": t.get("input_schema") or {"type": "object"}}})
    return out or None


async def messages_endpoint(server: LilyServer, f: Fields, arrived: float):
    _check_model(server, f)
    max_tokens = f.integer("max_tokens", _MISSING, lo=1)
    if max_tokens is _MISSING:
        raise _bad(f"{f.where}: 'max_tokens' is required", "max_tokens")
    messages = _anthropic_messages(f)
    tools = _anthropic_tools(f)
    choice = f.obj("tool_choice") or {"type": "auto"}
    if choice.get("type") == "none":
        tools = None
    elif choice.get("type") != "auto":
        raise _bad(f"{f.where}: tool_choice {json.dumps(choice.get('type'))[:40]} is not supported (only 'auto' and "
                   "'none'): forcing a call needs constrained decoding", "tool_choice", code="unsupported")
    kwargs = _template_kwargs(f)
    thinking = f.obj("thinking")
    if thinking is not None:
        if thinking.get("type") not in ("enabled", "disabled"):
            raise _bad(f"{f.where}: thinking.type must be 'enabled' or 'disabled'", "thinking")
        kwargs.setdefault("enable_thinking", thinking["type"] == "enabled")
    sampling = _sampling(f)
    stop = f.stops("stop_sequences")
    ids, in_reasoning, cuts = await _prepare(server, messages, tools, kwargs, f.where)
    max_tokens = server.check_prompt(ids, max_tokens, "messages", f.where)
    req = GenRequest(ids, max_tokens, sampling, stop, 0, f.boolean("ignore_eos", False), cuts)
    stream = f.boolean("stream", False)
    job = await server.submit(req, arrived)
    parser = OutputParser(in_reasoning=in_reasoning, tools=tools, stream_arguments=stream)
    mid, model = _new_id("msg_"), server.config.model_name

    def stop_reason(fin: Finish) -> tuple[str, str | None]:
        if parser.tool_calls and fin.reason == "stop":
            return "tool_use", None
        if fin.reason in ("length", "context"):
            return "max_tokens", None
        if fin.stop_sequence is not None:
            return "stop_sequence", fin.stop_sequence
        return "end_turn", None

    def usage(completion: int, cached: int = 0) -> dict:
        # Anthropic counts input_tokens apart from the cached ones
        return {"input_tokens": len(ids) - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0}

    if not stream:
        blocks: list[dict] = []
        fin = None

        def add(events: list) -> None:
            for kind, value in events:
                if kind == "tool_call":
                    blocks.append({"type": "tool_use", "id": _new_id("toolu_"), "name": value.name,
                                   "input": value.arguments})
                elif kind == "reasoning":
                    if blocks and blocks[-1]["type"] == "thinking":
                        blocks[-1]["thinking"] += value
                    else:
                        blocks.append({"type": "thinking", "thinking": value, "signature": ""})
                elif blocks and blocks[-1]["type"] == "text":
                    blocks[-1]["text"] += value
                else:
                    blocks.append({"type": "text", "text": value})

        async for item in server.events(job, f.request):
            if isinstance(item, Finish):
                fin = item
                break
            add(parser.feed(item.text))
        add(parser.finish())
        assert fin is not None
        reason, seq = stop_reason(fin)
        return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
                             "stop_reason": reason, "stop_sequence": seq,
                             "usage": usage(fin.completion_tokens, fin.cached)})

    async def body() -> AsyncIterator[str]:
        yield _sse({"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(0)}}, "message_start")
        index, open_kind = -1, None

        def close() -> list[str]:
            nonlocal open_kind
            if open_kind is None:
                return []
            open_kind = None
            return [_sse({"type": "content_block_stop", "index": index}, "content_block_stop")]

        def emit(events: list) -> list[str]:
            nonlocal index, open_kind
            out: list[str] = []
            for kind, value in events:
                if kind == "tool_call_begin":  # a tool_use block opens with the name; input follows in pieces
                    out += close()
                    index += 1
                    open_kind = "tool_use"
                    out.append(_sse({"type": "content_block_start", "index": index, "content_block": {
                        "type": "tool_use", "id": _new_id("toolu_"), "name": value[1], "input": {}}},
                        "content_block_start"))
                    continue
                if kind == "tool_call_args":
                    out.append(_sse({"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": value[1]}}, "content_block_delta"))
                    continue
                if kind == "tool_call" and open_kind == "tool_use":  # the announced call is complete
                    out += close()
                    continue
                if kind == "tool_call":
                    out += close()
                    index += 1
                    out.append(_sse({"type": "content_block_start", "index": index, "content_block": {
                        "type": "tool_use", "id": _new_id("toolu_"), "name": value.name, "input": {}}},
                        "content_block_start"))
                    out.append(_sse({"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(value.arguments, ensure_ascii=False)}},
                        "content_block_delta"))
                    out.append(_sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
                    continue
                block = "thinking" if kind == "reasoning" else "text"
                if open_kind != block:
                    out += close()
                    index += 1
                    open_kind = block
                    start = {"type": "thinking", "thinking": "", "signature": ""} if block == "thinking" else \
                        {"type": "text", "text": ""}
                    out.append(_sse({"type": "content_block_start", "index": index, "content_block": start},
                                    "content_block_start"))
                delta = {"type": "thinking_delta", "thinking": value} if block == "thinking" else \
                    {"type": "text_delta", "text": value}
                out.append(_sse({"type": "content_block_delta", "index": index, "delta": delta},
                                "content_block_delta"))
            return out

        try:
            fin = None
            async for item in server.events(job):
                if isinstance(item, Finish):
                    fin = item
                    break
                for s in emit(parser.feed(item.text)):
                    yield s
            for s in emit(parser.finish()) + close():
                yield s
            assert fin is not None
            reason, seq = stop_reason(fin)
            yield _sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": {"output_tokens": fin.completion_tokens, "input_tokens": len(ids) - fin.cached,
                                  "cache_read_input_tokens": fin.cached}}, "message_delta")
            yield _sse({"type": "message_stop"}, "message_stop")
        except APIError as exc:
            yield _sse(exc.anthropic(), "error")

    return StreamingResponse(body(), media_type="text/event-stream")


# ------------------------------------------------------------------------------------------------
# the app
# ------------------------------------------------------------------------------------------------

def _prometheus(m: dict) -> str:
    lines = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, Any]]) -> None:
        lines.append(f"# HELP lily_{name} {help_}")
        lines.append(f"# TYPE lily_{name} {kind}")
        for labels, value in samples:
            lines.append(f"lily_{name}{labels} {value}")

    metric("requests_total", "counter", "HTTP requests answered, by endpoint and status",
           [(f'{{endpoint="{r["endpoint"]}",status="{r["status"]}"}}', r["count"]) for r in m["requests"]])
    metric("prompt_tokens_total", "counter", "prompt tokens prefilled", [("", m["prompt_tokens"])])
    metric("completion_tokens_total", "counter", "tokens generated", [("", m["completion_tokens"])])
    metric("kept_sessions", "gauge", "closed sessions' states kept for reuse", [("", m["kept_sessions"])])
    metric("keep_sessions", "gauge", "how many closed sessions' states the engine keeps at most",
           [("", m["keep_sessions"])])
    metric("requests_rejected_total", "counter", "requests answered 429 (queue full)", [("", m["rejected"])])
    metric("requests_timed_out_total", "counter", "requests past request_timeout", [("", m["timed_out"])])
    metric("requests_cancelled_total", "counter", "generations stopped by a client disconnect",
           [("", m["cancelled"])])
    metric("active_requests", "gauge", "generations running", [("", m["active"])])
    metric("queue_depth", "gauge", "requests waiting for a slot", [("", m["queued"])])
    metric("resident_memory_bytes", "gauge", "process resident set size", [("", m["rss_bytes"])])
    cache = m.get("prefix_cache")
    if cache:
        metric("prefix_cache_hits_total", "counter", "prompts that restored a cached prefix", [("", cache["hits"])])
        metric("prefix_cache_misses_total", "counter", "prompts with no cached prefix", [("", cache["misses"])])
        metric("prefix_cache_tokens_saved_total", "counter", "prompt tokens not prefilled",
               [("", cache["tokens_saved"])])
        metric("prefix_cache_evictions_total", "counter", "checkpoints evicted", [("", cache["evictions"])])
        metric("prefix_cache_bytes", "gauge", "bytes held by checkpoints", [("", cache["bytes"])])
        metric("prefix_cache_entries", "gauge", "checkpoints held", [("", cache["entries"])])
        metric("prefix_cache_disk_hits_total", "counter", "prompts restored from a spilled checkpoint",
               [("", cache["disk_hits"])])
        metric("prefix_cache_disk_errors_total", "counter", "spilled checkpoints unreadable (a miss)",
               [("", cache["disk_errors"])])
        metric("prefix_cache_spilled_total", "counter", "checkpoints written to the disk tier", [("", cache["spilled"])])
        metric("prefix_cache_disk_bytes", "gauge", "bytes of spilled checkpoint files", [("", cache["disk_bytes"])])
        metric("prefix_cache_disk_entries", "gauge", "spilled checkpoint files", [("", cache["disk_entries"])])
    return "\n".join(lines) + "\n"


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; ``app.state.lily`` is the :class:`LilyServer`."""
    server = LilyServer(engine, config)
    app = FastAPI(title="Lily", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lily = server

    def error_response(request: Request, exc: APIError) -> JSONResponse:
        anthropic = request.url.path.startswith("/v1/messages")
        server.metrics.count(request.url.path, exc.status)
        return JSONResponse(exc.anthropic() if anthropic else exc.openai(), status_code=exc.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        return error_response(request, APIError(status, f"{request.method} {request.url.path}: {exc.detail}",
                                                type="invalid_request_error" if status < 500 else "server_error"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return error_response(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    async def body_of(request: Request, where: str) -> Fields:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(f"{where}: the request body is not valid JSON ({exc})", None) from None
        f = Fields(data, where)
        f.request = request
        return f

    def route(path: str, handler):
        async def endpoint(request: Request):
            arrived = time.monotonic()
            response = await handler(server, await body_of(request, f"POST {path}"), arrived)
            server.metrics.count(path, response.status_code)
            return response

        app.post(path)(endpoint)

    route("/v1/chat/completions", chat_completions)
    route("/v1/completions", completions)
    route("/v1/messages", messages_endpoint)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.config.model_name, "object": "model",
                                            "created": int(server.metrics.started), "owned_by": "lily",
                                            "max_model_len": server.config.max_context}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.config.model_name, "active": server.active,
                "queued": server.waiting}

    @app.get("/metrics")
    async def metrics(request: Request):
        m = server.metrics
        with m.lock:
            data = {
                "requests": [{"endpoint": e, "status": s, "count": c} for (e, s), c in sorted(m.requests.items())],
                "prompt_tokens": m.prompt_tokens, "completion_tokens": m.completion_tokens,
                "rejected": m.rejected, "timed_out": m.timed_out, "cancelled": m.cancelled,
            }
        data.update(active=server.active, queued=server.waiting, max_concurrency=server.config.max_concurrency,
                    max_queue=server.config.max_queue, rss_bytes=_rss_bytes(),
                    uptime_s=round(time.time() - m.started, 3),
                    prefix_cache=server.cache.stats() if server.cache is not None else None,
                    kept_sessions=server.engine.kept_sessions(), keep_sessions=server.engine.keep_sessions)
        fmt = request.query_params.get("format")
        if fmt == "prometheus" or (fmt is None and "text/plain" in request.headers.get("accept", "")):
            return PlainTextResponse(_prometheus(data), media_type="text/plain; version=0.0.4")
        return data

    return app


def serve(engine, host: str = "127.0.0.1", port: int = 8000, config: ServerConfig | None = None,
          log_level: str = "info") -> None:
    """Serve ``engine`` until interrupted."""
    uvicorn.run(create_app(engine, config), host=host, port=port, log_level=log_level)


class ServerThread:
    """The server on a background thread of this process (a notebook, a test, an app embedding Lily).

    ``port=0`` picks a free port; ``url`` is ``http://host:port``. ``stop()`` (or leaving ``with``) shuts
    it down; the engine stays open (it is the caller's)."""

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 0, config: ServerConfig | None = None,
                 log_level: str = "warning", start_timeout: float = 30.0):
        self.app = create_app(engine, config)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level))
        self._thread = threading.Thread(target=self._server.run, name="lily-server", daemon=True)
        self._thread.start()
        t0 = time.monotonic()
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > start_timeout:
                self._server.should_exit = True
                raise LilyError(f"the server did not start on {host}:{port}")
            time.sleep(0.01)
        bound = self._server.servers[0].sockets[0].getsockname()
        self.host, self.port = host, bound[1]
        self.url = f"http://{host}:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
