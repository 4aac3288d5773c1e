"""The HTTP front end: OpenAI's /v1/completions and /v1/chat/completions (streamed as server-sent events),
/v1/models, /health and /metrics, on FastAPI; one `Scheduler` thread does all device work.

Per request, on the event loop: parse and check the body, tokenize (chat through the checkpoint's template),
submit one engine request per prompt, then turn the tokens the engine thread posts back into text
(`TextStream`: UTF-8-safe, stop strings held back and matched), logprobs and usage. A matched stop string or a
client that disconnects cancels the engine request, which frees its slot before the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import random
import threading
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k26jax.serve import protocol as P
from k26jax.serve import scheduler as S
from k26jax.serve.text import TextStream

RETRY_AFTER_S = 1


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str
    max_len: int
    depth: int  # L: a sequence needs prompt + max_tokens + L + 1 cache rows
    vocab_size: int
    eos_ids: tuple[int, ...]
    max_logprobs: int
    api_key: str | None = None

    @property
    def context(self) -> int:
        """Prompt + completion tokens a request may ask for: the cache rows less the draft tree's L + 1."""
        return self.max_len - self.depth - 1


@dataclasses.dataclass(eq=False)
class Choice:
    """One prompt of a request: its engine request and what has been sent of it."""

    index: int
    prompt_tokens: int
    text: TextStream
    top: int | None  # logprobs asked: how many alternatives per token (None: no logprobs)
    req: S.Request | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    text_len: int = 0  # characters sent so far (the legacy logprobs' text_offset)


@dataclasses.dataclass
class Delta:
    index: int
    text: str
    logprobs: list  # [(token id, logprob, [(id, logprob), ...], text offset)]
    finish_reason: str | None


class Mailbox:
    """Hands the events the engine thread posts to the event loop's queues in one wake-up per batch: the engine
    thread delivers a step's tokens to every slot in turn, and a wake-up each (call_soon_threadsafe: a lock, a
    pipe write, a turn of the loop, under the GIL) is host time that a small model's sub-millisecond steps feel."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock, self.pending = loop, [], threading.Lock(), False

    def post(self, queue: asyncio.Queue, item):
        """Engine thread: queue.put_nowait(item) on the loop, in posting order. Raises once the loop is closed."""
        if self.loop.is_closed():
            raise RuntimeError("the event loop is closed")
        with self.lock:
            self.items.append((queue, item))
            if self.pending:
                return
            self.pending = True
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self):
        with self.lock:
            items, self.items, self.pending = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


class ApiKey:
    """ASGI middleware: every path but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app, key: str, metrics):
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = P.APIError(401, "Incorrect or missing API key", code="invalid_api_key")
                self.metrics.finished("rejected")
                await JSONResponse(err.body(), 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclasses.dataclass(eq=False)
class Job:
    """One HTTP request: its choices and the queue the engine thread posts their events to."""

    kind: str  # "chat" or "completion"
    choices: list[Choice]
    queue: asyncio.Queue
    stream: bool
    include_usage: bool
    ident: str

    @property
    def open(self) -> bool:
        return any(ch.finish_reason is None for ch in self.choices)

    def usage(self) -> dict:
        return P.usage(sum(c.prompt_tokens for c in self.choices), sum(c.completion_tokens for c in self.choices))


class Frontend:
    """The request handling of `create_app`: checks, submission, and the engine's tokens back to OpenAI's JSON."""

    def __init__(self, sched: S.Scheduler, tokenizer, cfg: ServerConfig):
        self.sched, self.tokenizer, self.cfg = sched, tokenizer, cfg
        self.mailbox: Mailbox | None = None

    def _mailbox(self, loop) -> Mailbox:
        """The running loop's Mailbox (one loop serves; a new one, as in tests, gets a new Mailbox)."""
        if self.mailbox is None or self.mailbox.loop is not loop:
            self.mailbox = Mailbox(loop)
        return self.mailbox

    def token_text(self, token: int) -> str:
        return self.tokenizer.encoding.decode_single_token_bytes(token).decode("utf-8", errors="replace")

    # ---- requests -> jobs --------------------------------------------------------------------------------------
    def completion_job(self, req: P.CompletionRequest) -> Job:
        self._check_model(req.model)
        sampling = P.check_sampling(req)
        top = P.check_logprobs(req.logprobs, self.cfg.max_logprobs, "logprobs")
        max_new = P.check_max_tokens(req.max_tokens, "max_tokens") or 16  # OpenAI's default for completions
        prompts = [(ids, "prompt") for ids in self._completion_prompts(req.prompt)]
        return self._submit("completion", prompts, max_new, "max_tokens", sampling, top, req.seed)

    def chat_job(self, req: P.ChatRequest) -> Job:
        self._check_model(req.model)
        sampling = P.check_sampling(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise P.bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
        top = P.check_logprobs(req.top_logprobs or 0, self.cfg.max_logprobs, "top_logprobs") if req.logprobs else None
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_new = P.check_max_tokens(req.max_completion_tokens or req.max_tokens, param)
        if not req.messages:
            raise P.bad_request("'messages' must not be empty", "messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        ids = self.tokenizer.apply_chat_template(messages)
        max_new = max_new or max(self.cfg.context - len(ids), 1)
        return self._submit("chat", [(ids, "messages")], max_new, param, sampling, top, req.seed)

    def _check_model(self, name: str):
        if name != self.cfg.model_name:
            raise P.APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")

    def _completion_prompts(self, prompt) -> list[list[int]]:
        """A string, strings, token ids or lists of token ids -> token ids per prompt."""
        if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
            prompt = [prompt]
        if not prompt:
            raise P.bad_request("'prompt' must not be empty", "prompt")
        out = []
        for p in prompt:
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise P.bad_request("'prompt' must not be empty", "prompt")
            bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
            if bad:
                vocab = self.cfg.vocab_size
                raise P.bad_request(f"'prompt': token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
            out.append(ids)
        return out

    def _submit(self, kind, prompts, max_new, max_param, sampling, top, seed) -> Job:
        """Check the lengths, then submit one engine request per prompt (all or none: 503 when the queue is full)."""
        cfg = self.cfg
        for ids, param in prompts:
            if len(ids) + max_new > cfg.context:
                raise P.bad_request(
                    f"This model's maximum context length is {cfg.context} tokens (--max-len {cfg.max_len} cache "
                    f"rows, less {cfg.depth + 1} for the draft tree). However, you requested {len(ids) + max_new} "
                    f"tokens ({len(ids)} in the prompt, {max_new} for the completion). Please reduce the length of "
                    f"the prompt or the completion.",
                    param if len(ids) + 1 > cfg.context else max_param,
                )
        mailbox = self._mailbox(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()
        seed = random.getrandbits(32) if seed is None else seed
        choices = []
        for i, (ids, _) in enumerate(prompts):

            def sink(event, i=i):
                mailbox.post(queue, (i, event))

            ch = Choice(i, len(ids), TextStream(self.tokenizer, sampling["stops"], cfg.eos_ids), top)
            ch.req = S.Request(ids, max_new, sampling["temperature"], sampling["top_p"], seed + i, sink)
            choices.append(ch)
        for n, ch in enumerate(choices):
            try:
                self.sched.submit(ch.req)
            except (S.QueueFull, S.Draining) as e:
                for earlier in choices[:n]:
                    self.sched.cancel(earlier.req)
                self.sched.metrics.finished("overloaded")
                headers = {"Retry-After": str(RETRY_AFTER_S)}
                raise P.APIError(503, str(e), type="server_error", headers=headers) from None
        ident = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
        return Job(kind, choices, queue, sampling["stream"], sampling["include_usage"], ident)

    # ---- engine events -> deltas ---------------------------------------------------------------------------------
    async def next_delta(self, job: Job) -> Delta:
        """The next text delta of any choice; raises APIError when the engine failed the request."""
        while True:
            i, event = await job.queue.get()
            ch = job.choices[i]
            if ch.finish_reason is not None:
                continue
            if isinstance(event, S.Emission):
                delta = self._feed(ch, event)
                if ch.text.stopped:
                    self.sched.cancel(ch.req, outcome="stop")
                    delta.finish_reason = ch.finish_reason = "stop"
                return delta
            if event[0] == "finished":
                ch.finish_reason = "stop" if ch.text.stopped else event[1]
                return Delta(i, ch.text.finish(), [], ch.finish_reason)
            error = event[1]
            raise P.APIError(503 if isinstance(error, S.Draining) else 500, str(error), type="server_error")

    def _feed(self, ch: Choice, em: S.Emission) -> Delta:
        text, lps = [], []
        for j, token in enumerate(em.tokens):
            piece = ch.text.feed(token)
            ch.completion_tokens += 1
            if ch.top is not None and em.logprobs is not None:
                lps.append((token, em.logprobs[j], em.top[j][: ch.top], ch.text_len))
            text.append(piece)
            ch.text_len += len(piece)
            if ch.text.stopped:
                break
        return Delta(ch.index, "".join(text), lps, None)

    def cancel(self, job: Job):
        for ch in job.choices:
            if ch.finish_reason is None:
                self.sched.cancel(ch.req)

    # ---- jobs -> responses -------------------------------------------------------------------------------------
    async def respond(self, request: Request, job: Job):
        """The JSON response, or an SSE stream that starts once the first tokens (or an error) came back, so a
        fault before any token is still an HTTP status. A client that disconnects cancels the job."""
        try:
            first = await _unless_disconnected(request, self.next_delta(job))
        except BaseException:
            self.cancel(job)
            raise
        if first is None:
            self.cancel(job)
            return Response(status_code=499)
        if job.stream:
            headers = {"Cache-Control": "no-cache"}
            return StreamingResponse(self._stream(job, first), media_type="text/event-stream", headers=headers)
        try:
            body = await _unless_disconnected(request, self._collect(job, first))
        finally:
            self.cancel(job)
        return Response(status_code=499) if body is None else JSONResponse(body)

    async def _collect(self, job: Job, first: Delta) -> dict:
        texts = {ch.index: [] for ch in job.choices}
        lps = {ch.index: [] for ch in job.choices}
        d = first
        while True:
            texts[d.index].append(d.text)
            lps[d.index] += d.logprobs
            if not job.open:
                break
            d = await self.next_delta(job)
        out = []
        for ch in job.choices:
            text = "".join(texts[ch.index])
            logprobs = self._logprobs(job.kind, lps[ch.index]) if ch.top is not None else None
            if job.kind == "chat":
                out.append({"index": ch.index, "message": {"role": "assistant", "content": text}})
            else:
                out.append({"index": ch.index, "text": text})
            out[-1].update(logprobs=logprobs, finish_reason=ch.finish_reason)
        return {
            "id": job.ident,
            "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": P.now(),
            "model": self.cfg.model_name,
            "choices": out,
            "usage": job.usage(),
        }

    async def _stream(self, job: Job, first: Delta) -> AsyncIterator[str]:
        """Server-sent events as OpenAI sends them: chunks, an optional usage chunk, then [DONE]. An engine error
        after the first chunk is sent as an {"error": ...} event (the status line has gone out)."""
        chat = job.kind == "chat"
        head = {
            "id": job.ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": P.now(),
            "model": self.cfg.model_name,
        }
        extra = {"usage": None} if job.include_usage else {}
        try:
            if chat:
                for ch in job.choices:
                    role = {"index": ch.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    yield P.sse({**head, "choices": [{**role, "finish_reason": None}], **extra})
            d = first
            while True:
                if d.text or d.logprobs or d.finish_reason is not None:
                    yield P.sse({**head, "choices": [self._chunk_choice(job, d)], **extra})
                if not job.open:
                    break
                d = await self.next_delta(job)
            if job.include_usage:
                yield P.sse({**head, "choices": [], "usage": job.usage()})
        except P.APIError as err:
            yield P.sse(err.body())
        finally:
            self.cancel(job)
        yield P.SSE_DONE

    def _chunk_choice(self, job: Job, d: Delta) -> dict:
        lp = self._logprobs(job.kind, d.logprobs) if job.choices[d.index].top is not None and d.logprobs else None
        if job.kind == "chat":
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            return {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
        return {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}

    def _logprobs(self, kind: str, items) -> dict:
        """OpenAI's logprobs object: chat's {"content": [...]}, or the legacy completions form."""
        text = self.token_text
        if kind == "chat":

            def entry(token, lp):
                return {"token": text(token), "logprob": lp, "bytes": list(text(token).encode())}

            content = [dict(entry(t, lp), top_logprobs=[entry(a, v) for a, v in top]) for t, lp, top, _ in items]
            return {"content": content}
        return {
            "tokens": [text(t) for t, _, _, _ in items],
            "token_logprobs": [lp for _, lp, _, _ in items],
            "top_logprobs": [{text(a): v for a, v in top} for _, _, top, _ in items],
            "text_offset": [offset for _, _, _, offset in items],
        }


async def _unless_disconnected(request: Request, work):
    """work's result, or None if the client disconnects first (work is then cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


async def _disconnect(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(sched: S.Scheduler, tokenizer, cfg: ServerConfig) -> FastAPI:
    """The FastAPI app over a started Scheduler."""
    app = FastAPI(title="k26jax", docs_url=None, redoc_url=None, openapi_url=None)
    if cfg.api_key:
        app.add_middleware(ApiKey, key=cfg.api_key, metrics=sched.metrics)
    front = Frontend(sched, tokenizer, cfg)
    created = P.now()

    def refused(status: int):  # a client's mistake (4xx); 503s count as "overloaded" where they are raised
        if 400 <= status < 500:
            sched.metrics.finished("rejected")

    @app.exception_handler(P.APIError)
    async def api_error(_, err: P.APIError):
        refused(err.status)
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, err: StarletteHTTPException):
        refused(err.status_code)
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return JSONResponse(P.APIError(err.status_code, str(err.detail), type=kind).body(), err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_, err: Exception):
        body = P.APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error").body()
        return JSONResponse(body, 500)

    @app.get("/health")
    async def health():
        if sched.draining or not sched.alive():
            return JSONResponse({"status": "draining" if sched.draining else "engine stopped"}, 503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": cfg.model_name, "object": "model", "created": created, "owned_by": "k26jax"}
        return {"object": "list", "data": [dict(card, max_model_len=cfg.context)]}

    @app.get("/metrics")
    async def metrics():
        return Response(sched.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        job = front.completion_job(P.parse(P.CompletionRequest, await request.body()))
        return await front.respond(request, job)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        job = front.chat_job(P.parse(P.ChatRequest, await request.body()))
        return await front.respond(request, job)

    return app
