"""The OpenAI-compatible HTTP server: a FastAPI app on top of chapter 10's `AsyncLLM`, as vLLM's
`vllm/entrypoints/openai/api_server.py` builds one (`build_app`). This is plumbing, not taught: the chapter
teaches the engine loop (`minivllm/engine/async_llm.py`) and streaming with hold-back
(`minivllm/entrypoints/openai_server.py`); this module puts them behind HTTP.

Endpoints:

    POST /v1/completions        OpenAI's completions, streamed (server-sent events) or not; `prompt` is a text,
                                token ids, or a list of either (prompts x n choices, prompt i's choice j at i*n+j)
    POST /v1/chat/completions   OpenAI's chat completions, through the model's chat template
    GET  /v1/models             vLLM's model cards, one per served name (`root`: the model loaded)
    POST /tokenize, /detokenize as vLLM's
    GET  /health, /ping         200 while the engine can serve, else 503 naming why (health.py); no API key
    GET  /version               {"version": minivllm's}
    GET  /metrics               Prometheus text format (minivllm/entrypoints/openai/metrics.py)

GET routes answer HEAD too; OPTIONS answers with the allowed methods (and CORS preflights, as vLLM's).
Supported request fields: `n`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `max_tokens`
(`max_completion_tokens` in chat), `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `min_tokens`,
`stop`, `stop_token_ids`, `ignore_eos`, `include_stop_str_in_output`, `skip_special_tokens`,
`add_special_tokens` (completions), `add_generation_prompt` (chat), `logprobs` (completions: 0 to 20
alternatives; chat: true, with `top_logprobs` 0 to 20), `cache_salt`, `stream`, `stream_options`
(`include_usage`, and `continuous_usage_stats`: usage in every chunk), `user` (the client, below). OpenAI's and vLLM's
other fields are accepted at a value that asks for nothing (`echo: false`, `tools: null`, ...; the list is
`VLLMNoOps` in protocol.py) and refused by name otherwise; an unknown field is a 400 naming it. Choices carry
vLLM's `stop_reason`; `usage.prompt_tokens_details.cached_tokens` (the prompt tokens served from the prefix cache)
only with `enable_prompt_tokens_details` (vLLM's --enable-prompt-tokens-details), else null. Each 4xx is
logged with the field it names (logger `minivllm.entrypoints.openai`).

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
| request line + headers | 64 KiB in all (uvicorn's `h11_max_incomplete_event_size` while they arrive, the guard's check once they have) | 400 from uvicorn, or 431 |
| header count | 100 (`max_headers`) | 431 |
| request line + headers arrival | within 10 s of connecting or of the previous response (`header_timeout`) | 408, closed |
| idle keep-alive connection | closed after 5 s (uvicorn's `timeout_keep_alive`) | closed |
| connections + requests in progress | 1,000 (uvicorn's `limit_concurrency`) | 503 |
| prompt | shorter than the engine's `max_model_len` tokens; token ids in the vocabulary | 400 |
| `n`, `stop` (number and length), `stop_token_ids`, `max_tokens`, `seed`, `top_k`, ... | `SamplingParams`' own bounds (minivllm/sampling_checks.py) | 400 |
| prompts x `n` x `max_tokens` (`max_tokens` unset: the rest of the context) | 32,768 tokens per request (`max_tokens_per_request`) | 400 naming `prompt` for a batch, else `n` (`max_tokens` when n = 1) |
| `logprobs`, `top_logprobs` | 0 to 20 | 400 |
| `cache_salt` | 1 to 1,024 characters | 400 |
| `user` | at most 256 characters | 400 |
| one client's requests in the engine | `client_share` of the seats and of the token budget (0.5) | waits its turn |
| JSON | pydantic's parser: nesting of 200 levels at most, integers of 4,300 digits at most, valid UTF-8 and no lone surrogates | 400 |

**Fairness across clients** (chapter 10's `AsyncLLM`): a client's requests hold at most `client_share` (a
half) of the engine's seats (`max_num_seqs`) and of its token budget (`max_num_batched_tokens`, in prompt
tokens not yet prefilled); the rest wait in front of the engine, clients taking turns. The client is the
request's `user` field (at most 256 characters; OpenAI's end-user identifier, which vLLM accepts and ignores);
a request without one (or with `""`) is a client of its own, its prompts together, so callers that name no
one are scheduled as before. `user` is what the caller says: it lets an application or gateway keep its end
users from starving each other, not stop a hostile caller, who can omit it or vary it.

**A stalled engine.** A step that has run for longer than `stall_timeout` seconds (300, as vLLM's
`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`) means the engine cannot serve: `/health` says 503, new requests get a 503,
and the watchdog stops the server (health.py).

A client that hangs up, streaming or not, has its request aborted at the engine's next step boundary, which
frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm import __version__
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.chat import render_chat_template
from minivllm.entrypoints.openai.guards import (GuardMiddleware, Limits, error_response, log_refusal, read_body,
                                               until_disconnect)
from minivllm.entrypoints.openai.health import engine_problem
from minivllm.entrypoints.openai.metrics import ServerMetrics
from minivllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                  DetokenizeRequest, TokenizeRequest, error_body,
                                                  parse, to_sampling_params)
from minivllm.entrypoints.openai.responses import Responses, event, merged, running_usage, usage
from minivllm.entrypoints.openai_server import stream_deltas


def engine_param(message: str, chat: bool) -> str:
    """The request field an engine refusal is about: a sampling field it names, else the prompt."""
    for name in ("cache_salt", "logprobs", "stop_token_ids", "stop", "seed", "n", "max_tokens", "min_tokens"):
        if message.startswith(tuple(f"{prefix}{name}{end}" for prefix in ("", "SamplingParams.")
                                    for end in (" ", "=", ":"))):
            return name
    return "messages" if chat else "prompt"


def check_request_tokens(params, prompt_lens: list[int], max_model_len: int, limits: Limits) -> None:
    """A server-wide cap on what one request may generate: prompts x n x max_tokens (max_tokens None: the rest
    of the context), so that no single request holds the engine for everyone else (issue 29's n = 512 x 400)."""
    total = sum(params.n * (params.max_tokens if params.max_tokens is not None else max(1, max_model_len - length))
                for length in prompt_lens)
    if total > limits.max_tokens_per_request:
        what = (f"{len(prompt_lens)} prompts x n = {params.n} x max_tokens" if len(prompt_lens) > 1
                else f"n x max_tokens = {params.n} x {total // params.n}")
        raise APIError(400, f"{what} = {total} tokens: this server generates at most "
                            f"{limits.max_tokens_per_request} per request",
                       "prompt" if len(prompt_lens) > 1 else "n" if params.n > 1 else "max_tokens")


class OpenAIServing:
    """The route handlers."""

    def __init__(self, llm, model_names: list[str], limits: Limits, model_path: str | None = None,
                 prompt_details: bool = False):
        self.engine = AsyncLLM(llm, limits.client_share, limits.stall_timeout)
        self.prompt_details = prompt_details
        self.tokenizer, self.model_names, self.limits = llm.tokenizer, model_names, limits
        self.model_name, self.model_path = model_names[0], model_path or model_names[0]
        self.max_model_len = llm.engine.config.max_model_len
        self.vocab_size = llm.engine.model.config.vocab_size
        self.metrics = ServerMetrics(self.engine, self.model_name, self.max_model_len)
        self.responses = Responses(self.tokenizer)
        self.started = int(time.time())
        self.cpu = ThreadPoolExecutor(2, thread_name_prefix="minivllm-tokenize")  # off the event loop

    async def off_loop(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.cpu, function, *args)

    def check_model(self, model: str | None) -> None:
        """As vLLM: no model (or an empty one) is the served model; any of the served names is too."""
        if model and model not in self.model_names:
            raise APIError(404, f"the model {model!r} does not exist; this server has "
                                f"{', '.join(map(repr, self.model_names))}", "model")

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
        prompts = request.prompts()
        if not prompts:
            raise APIError(400, "prompt: an empty list", "prompt")
        if any(isinstance(p, str) for p in prompts):
            self.need_tokenizer("prompt")
        encode = lambda text: self.encode(text, request.add_special_tokens)  # noqa: E731
        batch = [(await self.off_loop(encode, p), p) if isinstance(p, str) else (p, None) for p in prompts]
        return await until_disconnect(raw, self.generate(request, batch, chat=False))

    async def chat(self, raw: Request):
        request = parse(ChatCompletionRequest, await read_body(raw, self.limits))
        self.check_model(request.model)
        self.need_tokenizer("messages", chat=True)
        text = await self.off_loop(self.render_chat, request.messages, request.add_generation_prompt)
        token_ids = await self.off_loop(self.encode, text, False)
        return await until_disconnect(raw, self.generate(request, [(token_ids, text)], chat=True))

    async def generate(self, request, prompts: list[tuple[list[int], str | None]], chat: bool):
        """Each prompt a request of the engine; the answer has prompts x n choices, prompt i's choice j at
        index i * n + j. Every prompt is checked before any reaches the engine."""
        params = to_sampling_params(request)
        if (problem := engine_problem(self.engine)) is not None:
            raise APIError(503, f"the engine cannot serve: {problem}")
        check_request_tokens(params, [len(ids) for ids, _ in prompts], self.max_model_len, self.limits)
        for i, (token_ids, _) in enumerate(prompts):
            try:
                self.engine.engine.validate("check", token_ids, params, request.cache_salt)
            except ValueError as error:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                raise APIError(400, where + str(error), engine_param(str(error), chat)) from None
        arrival = time.perf_counter()
        client = f"user:{request.user}" if request.user else f"request:{uuid.uuid4().hex}"  # see the docstring
        streams = [self.engine.generate(ids, params, text, request.cache_salt, client) for ids, text in prompts]
        firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for stream in streams:
                await stream.aclose()
            if isinstance(failed, ValueError):  # the engine's checks, before any work
                raise APIError(400, str(failed), engine_param(str(failed), chat)) from None
            if isinstance(failed, RuntimeError):
                raise APIError(500, str(failed)) from None
            raise failed
        header = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                  "model": self.model_name}
        timed = [self.timed(first, stream, arrival, params) for first, stream in zip(firsts, streams)]
        if request.stream:
            events = self.sse(header, chat, timed, params, request)
            return ClosingStreamingResponse(events, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})
        finals = list(firsts)
        async with aclosing(merged(timed)) as outputs:
            try:
                async for i, output in outputs:
                    finals[i] = output
            except RuntimeError as error:  # a step failed this request
                raise APIError(500, str(error)) from None

        def answer():  # off the event loop: with n choices and logprobs, this can be a large body
            choices = [self.responses.choice(i * params.n + c.index, chat, False, c.text, c.token_ids, c.logprobs, 0)
                       | {"finish_reason": c.finish_reason, "stop_reason": self.responses.stop_reason(c, params)}
                       for i, final in enumerate(finals) for c in final.outputs]
            return JSONResponse({**header, "object": "chat.completion" if chat else "text_completion",
                                 "choices": choices, "usage": usage(finals, self.prompt_details)})

        return await self.off_loop(answer)

    async def timed(self, first, outputs, arrival: float, params):
        """A request's outputs, the first one included, timing them: TTFT, the gaps between outputs (one step
        each), and the request's end-to-end latency once it finishes."""
        async with aclosing(outputs):
            first_time = last = time.perf_counter()
            self.metrics.ttft.observe(first_time - arrival)
            output = first
            while True:
                if output.finished:
                    self.metrics.finished(output, params, arrival, first_time, time.perf_counter())
                yield output
                try:
                    output = await anext(outputs)
                except StopAsyncIteration:
                    return
                now = time.perf_counter()
                self.metrics.itl.observe(now - last)
                last = now

    async def sse(self, header, chat: bool, streams, params, request):
        """Server-sent events: one per piece of a choice's text, then usage if asked, then [DONE]."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        n, options = params.n, request.stream_options
        include_usage = options is not None and bool(options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)  # as vLLM: only with include_usage
        prompt_tokens = [0] * len(streams)
        tokens = [0] * (n * len(streams))  # tokens sent so far, per choice
        offsets = [0] * (n * len(streams))  # characters of token text so far, per choice (completions' text_offset)
        finals = [None] * len(streams)
        deltas = [stream_deltas(stream, params.stop_strings) for stream in streams]
        try:
            async with aclosing(merged(deltas)) as pieces:
                async for i, (output, delta) in pieces:
                    if finals[i] is None and chat:  # OpenAI's chat stream opens with the assistant's role
                        for j in range(n):
                            chunk = {**header, "object": kind, "choices": [{"index": j, "delta": {
                                "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
                            yield event(chunk | ({"usage": running_usage(len(output.prompt_token_ids), 0)}
                                                 if continuous else {}))
                    finals[i], prompt_tokens[i] = output, len(output.prompt_token_ids)
                    for piece in delta:
                        index = i * n + piece.index
                        choice = self.responses.choice(index, chat, True, piece.text, piece.token_ids,
                                                       piece.logprobs, offsets[index])
                        tokens[index] += len(piece.token_ids)
                        if piece.logprobs is not None:
                            offsets[index] += sum(len(self.responses.token_text(t)) for t in piece.token_ids)
                        completion = output.outputs[[c.index for c in output.outputs].index(piece.index)]
                        stop = None if piece.finish_reason is None else self.responses.stop_reason(completion, params)
                        chunk = {**header, "object": kind, "choices": [
                            choice | {"finish_reason": piece.finish_reason, "stop_reason": stop}]}
                        yield event(chunk | ({"usage": running_usage(prompt_tokens[i], tokens[index])}
                                             if continuous else {}))
        except RuntimeError as error:  # the engine failed this request after the stream began: say so in it
            yield event(error_body(500, str(error)))
            finals = [None]
        finally:  # however the stream ends (a hang-up closes this generator): close the requests' streams,
            for stream in streams:  # which aborts those still running
                await stream.aclose()
        if include_usage and all(f is not None for f in finals):
            yield event({**header, "object": kind, "choices": [], "usage": usage(finals, self.prompt_details)})
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ the rest of vLLM's endpoints
    async def models(self):
        """vLLM's model cards (`ModelCard`, vllm/entrypoints/serve/engine/protocol.py): one per served name,
        `root` the model it was loaded from; `vllm bench serve` reads `root` when it is given no --model."""
        permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": self.started,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.started, "owned_by": "minivllm", "root": self.model_path,
             "parent": None, "max_model_len": self.max_model_len, "permission": [permission]}
            for name in self.model_names]}

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
                "token_strs": [self.responses.token_text(t) for t in ids] if request.return_token_strs else None}

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


def build_app(llm, model_name: str | list[str] = "minivllm", api_key: str | None = None, limits: Limits = Limits(),
              model_path: str | None = None, enable_prompt_tokens_details: bool = False,
              path_keys: dict[str, str] | None = None) -> FastAPI:
    """The FastAPI app serving `llm` (an `LLM`) under `model_name` (one name or several, as vLLM's
    --served-model-name: the first is the one responses carry); `model_path` is the cards' `root` (default:
    the first name). `path_keys`: paths that need another key than `api_key` (a replica's operator key for
    /kv_events). `app.state.serving.engine` is its AsyncLLM."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or not all(names):
        raise ValueError(f"model_name: {model_name!r}: one or more non-empty names")
    serving = OpenAIServing(llm, names, limits, model_path, enable_prompt_tokens_details)

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

    async def health():  # vLLM's: 503 once the engine is dead
        problem = engine_problem(serving.engine)
        return Response(status_code=200) if problem is None else error_response(503, f"engine dead: {problem}")

    async def version():
        return {"version": __version__}

    async def metrics():
        body, content_type = serving.metrics.render()
        return Response(body, media_type=content_type)

    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", metrics, methods=["GET", "HEAD"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) health check
    app.add_api_route("/version", version, methods=["GET"])

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        log_refusal(request, error.status, error.message, error.param)
        return error_response(error.status, error.message, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.url.path} does not take {request.method}"}
        message = message.get(error.status_code, str(error.detail))
        log_refusal(request, error.status_code, message, None)
        return error_response(error.status_code, message, headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        log_refusal(request, 400, str(error), None)
        return error_response(400, str(error))

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):  # a bug: reported, not hidden
        return error_response(500, f"{type(error).__name__}: {error}")

    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(GuardMiddleware, router=app.router, limits=limits, api_key=api_key, path_keys=path_keys)
    return app
