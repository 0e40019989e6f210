"""The OpenAI-compatible HTTP server: a FastAPI app on top of chapter 10's `AsyncLLM`, as vLLM's
`vllm/entrypoints/openai/api_server.py` builds one (`build_app`). This is plumbing, not taught: the chapter
teaches the engine loop (`minivllm/engine/async_llm.py`) and streaming with hold-back
(`minivllm/entrypoints/openai_server.py`); this module puts them behind HTTP.

Endpoints:

    POST /v1/completions        OpenAI's completions, streamed (server-sent events) or not
    POST /v1/chat/completions   OpenAI's chat completions, through the model's chat template
    GET  /v1/models             the one served model
    POST /tokenize, /detokenize as vLLM's
    GET  /health                200 while the server serves; never needs the API key
    GET  /metrics               Prometheus text format (minivllm/entrypoints/openai/metrics.py)

GET routes answer HEAD too; OPTIONS answers with the allowed methods (and CORS preflights, as vLLM's).
Supported request fields: `n`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `max_tokens`
(`max_completion_tokens` in chat), `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `min_tokens`,
`stop`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`,
`skip_special_tokens`, `logprobs` (completions: 0 to 20 alternatives; chat: true, with `top_logprobs` 0 to
20), `cache_salt`, `stream`, `stream_options.include_usage`, `user` (ignored). Any other field is a 400
naming it. `usage.prompt_tokens_details.cached_tokens` reports the prompt tokens served from the prefix cache.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`; a 4xx names the field in
`param` where there is one. A request never reaches the engine unless it is valid.

**API key.** With `api_key` (`python -m minivllm serve --api-key KEY`), every path but `/health` (and
CORS preflights) needs `Authorization: Bearer KEY`, `/metrics` included: its prefix-cache counters are an
oracle for other tenants' prompts (chapter 10). vLLM protects only `/v1/*`.

**Limits** (the `Limits` defaults; over a bound is a 4xx, never a slow death):

| what | bound | over it |
|---|---|---|
| request body | 1 MiB (`max_body_bytes`), with or without Content-Length (chunked) | 413 |
| body arrival | within 30 s of the headers (`body_timeout`) | 408 |
| request line + headers | 64 KiB in all (uvicorn's `h11_max_incomplete_event_size`) | 400 from uvicorn |
| header count | 100 (`max_headers`) | 431 |
| request line + headers arrival | within 10 s of connecting or of the previous response (`header_timeout`) | 408, closed |
| idle keep-alive connection | closed after 5 s (uvicorn's `timeout_keep_alive`) | closed |
| connections + requests in progress | 1,000 (uvicorn's `limit_concurrency`) | 503 |
| prompt | shorter than the engine's `max_model_len` tokens; token ids in the vocabulary | 400 |
| `n`, `stop` (number and length), `stop_token_ids`, `max_tokens`, `seed`, `top_k`, ... | `SamplingParams`' own bounds (minivllm/sampling_checks.py) | 400 |
| `n` x `max_tokens` (`max_tokens` unset: the rest of the context) | 32,768 tokens per request (`max_tokens_per_request`) | 400 naming `n` (or `max_tokens` when n = 1) |
| `logprobs`, `top_logprobs` | 0 to 20 | 400 |
| `cache_salt` | 1 to 1,024 characters | 400 |
| JSON | pydantic's parser: nesting of 200 levels at most, integers of 4,300 digits at most, valid UTF-8 and no lone surrogates | 400 |

A client that hangs up, streaming or not, has its request aborted at the engine's next step boundary, which
frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.chat import render_chat_template
from minivllm.entrypoints.openai.guards import GuardMiddleware, Limits, error_response, read_body, until_disconnect
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest, error_body,
                                                  parse, to_sampling_params)
from minivllm.entrypoints.openai_server import stream_deltas


def engine_param(message: str, chat: bool) -> str:
    """The request field an engine refusal is about: a sampling field it names, else the prompt."""
    for name in ("cache_salt", "logprobs", "stop", "seed", "n", "max_tokens", "min_tokens"):
        if message.startswith(tuple(f"{prefix}{name}{end}" for prefix in ("", "SamplingParams.")
                                    for end in (" ", "=", ":"))):
            return name
    return "messages" if chat else "prompt"


def check_request_tokens(params, prompt_len: int, max_model_len: int, limits: Limits) -> None:
    """A server-wide cap on what one request may generate: n x max_tokens (max_tokens None: the rest of the
    context), so that no single request holds the engine for everyone else (issue 29's n = 512 x 400)."""
    tokens = params.max_tokens if params.max_tokens is not None else max(1, max_model_len - prompt_len)
    if params.n * tokens > limits.max_tokens_per_request:
        raise APIError(400, f"n x max_tokens = {params.n} x {tokens} = {params.n * tokens} tokens: this server "
                            f"generates at most {limits.max_tokens_per_request} per request", "n" if params.n > 1
                       else "max_tokens")


class OpenAIServing:
    """The route handlers."""

    def __init__(self, llm, model_name: str, limits: Limits):
        self.engine = AsyncLLM(llm)
        self.tokenizer, self.model_name, self.limits = llm.tokenizer, model_name, limits
        self.max_model_len = llm.engine.config.max_model_len
        self.vocab_size = llm.engine.model.config.vocab_size
        self.metrics = ServerMetrics(self.engine)
        self.cpu = ThreadPoolExecutor(2, thread_name_prefix="minivllm-tokenize")  # off the event loop
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs

    async def off_loop(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.cpu, function, *args)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server has {self.model_name!r}", "model")

    def need_tokenizer(self, param: str, chat: bool = False) -> None:
        if self.tokenizer is None or (chat and not self.tokenizer.chat_template):
            what = "no chat template: use /v1/completions" if chat else "no tokenizer: send token ids"
            raise APIError(400, f"this model has {what}", param)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """The messages through the chat template, as `LLM.chat` renders them (under its time limit)."""
        plain = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return render_chat_template(self.tokenizer, plain, add_generation_prompt)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from None

    # ------------------------------------------------------------------ the generation endpoints
    async def completions(self, raw: Request):
        request = parse(CompletionRequest, await read_body(raw, self.limits))
        self.check_model(request.model)
        if isinstance(request.prompt, str):
            self.need_tokenizer("prompt")
            token_ids, text = await self.off_loop(self.encode, request.prompt), request.prompt
        else:
            token_ids, text = request.prompt, None
        return await until_disconnect(raw, self.generate(request, token_ids, text, chat=False))

    async def chat(self, raw: Request):
        request = parse(ChatCompletionRequest, await read_body(raw, self.limits))
        self.check_model(request.model)
        self.need_tokenizer("messages", chat=True)
        text = await self.off_loop(self.render_chat, request.messages)
        token_ids = await self.off_loop(self.encode, text, False)
        return await until_disconnect(raw, self.generate(request, token_ids, text, chat=True))

    async def generate(self, request, token_ids: list[int], prompt: str | None, chat: bool):
        params = to_sampling_params(request)
        check_request_tokens(params, len(token_ids), self.max_model_len, self.limits)
        arrival = time.perf_counter()
        outputs = self.engine.generate(token_ids, params, prompt, request.cache_salt)
        try:
            first = await anext(outputs)
        except ValueError as error:  # the engine's checks, before any work
            raise APIError(400, str(error), engine_param(str(error), chat)) from None
        except RuntimeError as error:
            raise APIError(500, str(error)) from None
        first_time = time.perf_counter()
        self.metrics.ttft.observe(first_time - arrival)
        header = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                  "model": self.model_name}
        timed = self.timed(first, outputs)
        if request.stream:
            events = self.sse(header, chat, timed, params, request, (arrival, first_time))
            return ClosingStreamingResponse(events, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})
        async with aclosing(timed):
            try:
                async for final in timed:
                    pass
            except RuntimeError as error:  # a step failed this request
                raise APIError(500, str(error)) from None
        self.metrics.finished(final, arrival, first_time, time.perf_counter())

        def answer():  # off the event loop: with n choices and logprobs, this can be a large body
            choices = [self.choice(c, chat, c.text, c.token_ids, c.logprobs, request, 0)
                       | {"finish_reason": c.finish_reason} for c in final.outputs]
            return JSONResponse({**header, "object": "chat.completion" if chat else "text_completion",
                                 "choices": choices, "usage": usage(final)})

        return await self.off_loop(answer)

    async def timed(self, first, outputs):
        """The request's outputs, the first one included, timing the gaps between them (one step each)."""
        async with aclosing(outputs):
            yield first
            last = time.perf_counter()
            async for output in outputs:
                now = time.perf_counter()
                self.metrics.itl.observe(now - last)
                last = now
                yield output

    async def sse(self, header, chat: bool, outputs, params, request, times):
        """Server-sent events: one per piece of a choice's text, then usage if asked, then [DONE]."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        if chat:  # OpenAI's chat stream opens with the assistant's role
            for i in range(params.n):
                yield event({**header, "object": kind, "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}]})
        offsets = [0] * params.n  # characters of token text so far, per choice (completions' text_offset)
        final = None
        try:
            async with aclosing(outputs), aclosing(stream_deltas(outputs, params.stop_strings)) as deltas:
                async for final, pieces in deltas:
                    for piece in pieces:
                        choice = self.choice(piece, chat, piece.text, piece.token_ids, piece.logprobs, request,
                                             offsets[piece.index])
                        if piece.logprobs is not None:
                            offsets[piece.index] += sum(len(self.token_text(t)) for t in piece.token_ids)
                        yield event({**header, "object": kind, "choices": [
                            {"index": piece.index, **choice, "finish_reason": piece.finish_reason}]})
        except RuntimeError as error:  # the engine failed this request after the stream began: say so in it
            yield event(error_body(500, str(error)))
            final = None
        if final is not None:
            self.metrics.finished(final, times[0], times[1], time.perf_counter())
            if request.stream_options is not None and request.stream_options.include_usage:
                yield event({**header, "object": kind, "choices": [], "usage": usage(final)})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ response pieces
    def choice(self, completion, chat: bool, text: str, token_ids, logprobs, request, offset: int) -> dict:
        streaming = bool(request.stream)
        if chat:
            body = {"delta": {"content": text}} if streaming else {"message": {"role": "assistant", "content": text}}
        else:
            body = {"text": text}
        body["index"] = completion.index
        body["logprobs"] = None if logprobs is None else (
            self.chat_logprobs(token_ids, logprobs) if chat else self.completion_logprobs(token_ids, logprobs, offset))
        return body

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text  # at most the vocabulary
        return text

    def completion_logprobs(self, token_ids, logprobs, offset: int) -> dict:
        """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = []
        for token_id, (chosen, alternatives) in zip(token_ids, logprobs):
            entry = {self.token_text(t): lp for t, lp in alternatives}
            entry.setdefault(self.token_text(token_id), chosen)  # the sampled token, as vLLM adds it
            top.append(entry)
        return {"tokens": tokens, "token_logprobs": [chosen for chosen, _ in logprobs], "top_logprobs": top,
                "text_offset": offsets}

    def chat_logprobs(self, token_ids, logprobs) -> dict:
        def item(token_id, logprob):
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

        return {"content": [item(t, chosen) | {"top_logprobs": [item(a, lp) for a, lp in alternatives]}
                            for t, (chosen, alternatives) in zip(token_ids, logprobs)]}

    # ------------------------------------------------------------------ the rest of vLLM's endpoints
    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "minivllm", "max_model_len": self.max_model_len}]}

    async def tokenize(self, raw: Request):
        request = parse(TokenizeRequest, await read_body(raw, self.limits))
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "send either prompt or messages", "prompt")
        if request.messages is not None:
            self.need_tokenizer("messages", chat=True)
            text = await self.off_loop(self.render_chat, request.messages, request.add_generation_prompt)
            special = bool(request.add_special_tokens)
        else:
            self.need_tokenizer("prompt")
            text, special = request.prompt, request.add_special_tokens is not False
        ids = await self.off_loop(self.encode, text, special)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": [self.token_text(t) for t in ids] if request.return_token_strs else None}

    async def detokenize(self, raw: Request):
        request = parse(DetokenizeRequest, await read_body(raw, self.limits))
        self.check_model(request.model)
        self.need_tokenizer("tokens")
        bad = [t for t in request.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} outside the vocabulary [0, {self.vocab_size})", "tokens")
        return {"prompt": await self.off_loop(self.tokenizer.decode, request.tokens)}


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its generator however the response ends. Starlette cancels a stream
    whose client has gone, possibly while the generator waits at a `yield`; closing it runs its `finally`
    blocks now, down to AsyncLLM's, which aborts the request."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(output) -> dict:
    completion = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": completion,
            "total_tokens": len(output.prompt_token_ids) + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}


def build_app(llm, model_name: str = "minivllm", api_key: str | None = None, limits: Limits = Limits()) -> FastAPI:
    """The FastAPI app serving `llm` (an `LLM`); `app.state.serving.engine` is its AsyncLLM."""
    serving = OpenAIServing(llm, model_name, limits)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await serving.engine.shutdown()
        serving.cpu.shutdown(wait=False)

    app = FastAPI(title="minivllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", serving.chat, methods=["POST"])
    app.add_api_route("/v1/models", serving.models, methods=["GET", "HEAD"])
    app.add_api_route("/tokenize", serving.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", serving.detokenize, methods=["POST"])

    async def health():
        return Response(status_code=200)

    async def metrics():
        body, content_type = serving.metrics.render()
        return Response(body, media_type=content_type)

    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", metrics, methods=["GET", "HEAD"])

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return error_response(error.status, error.message, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.url.path} does not take {request.method}"}
        return error_response(error.status_code, message.get(error.status_code, str(error.detail)),
                              headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        return error_response(400, str(error))

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):  # a bug: reported, not hidden
        return error_response(500, f"{type(error).__name__}: {error}")

    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(GuardMiddleware, router=app.router, limits=limits, api_key=api_key)
    return app
