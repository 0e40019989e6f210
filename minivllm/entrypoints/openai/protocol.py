"""The OpenAI protocol's request bodies as pydantic models (chapter 10's plumbing, as vLLM's
`vllm/entrypoints/openai/protocol.py`), the error body, and the conversion of a request into `SamplingParams`.

A body is parsed by pydantic's own JSON parser (`model_validate_json`), not by `json.loads`: it refuses
nesting deeper than 200 levels, integers of more than 4,300 digits, lone UTF-16 surrogates (`"\\ud800"`)
and invalid UTF-8 with an ordinary validation error, which the server answers with a 400. The models are
strict: `"2"` is not an integer and `1` is not a boolean; fields they do not know are refused by name rather
than silently ignored. OpenAI's and vLLM's fields that minivllm does not implement (`VLLMNoOps`) are accepted at
the value that asks for nothing, as clients send them by default, and refused by name at any other. Ranges of the sampling fields are checked once, by `SamplingParams` itself
(minivllm/sampling_checks.py); the ranges below are the protocol's own.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from minivllm.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default --max-logprobs
MAX_CACHE_SALT_CHARS = 1024
MAX_USER_CHARS = 256  # the `user` field: the client whose share of the engine a request counts against

SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids",
                   "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens")


class APIError(Exception):
    """An error the client caused (4xx) or the server's (5xx), answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
               408: "RequestTimeout", 413: "RequestTooLarge", 431: "RequestHeaderFieldsTooLarge",
               500: "InternalServerError", 503: "ServiceUnavailable"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's (and vLLM's `ErrorResponse`) error object."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


class OpenAIModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _same(value, allowed) -> bool:
    """JSON equality: `true` is not `1`, `1` is `1.0`."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    return value == allowed


def NoOp(*allowed, kinds: tuple[type, ...] = ()):
    """A field minivllm accepts only at a value that asks for nothing (null, false, empty, ...), or at any value
    of `kinds` (labels such as `metadata` that ask nothing of the engine); another value is a 400 naming it."""

    def check(value):
        if value is None or any(_same(value, a) for a in allowed) or (kinds and isinstance(value, kinds)
                                                                      and not isinstance(value, bool)):
            return value
        accepted = ", ".join(["null", *(json.dumps(a) for a in allowed), *(k.__name__ for k in kinds)])
        raise ValueError(f"{json.dumps(value)[:80]} asks for something minivllm does not implement "
                         f"(accepted: {accepted})")

    return Annotated[Any, AfterValidator(check)]


class StreamOptions(OpenAIModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingFields(OpenAIModel):
    """The fields both generation endpoints share: OpenAI's, plus vLLM's extras (`top_k`, `min_p`,
    `ignore_eos`, `stop_token_ids`, ..., which the `openai` client sends through `extra_body`), and the fields
    clients send at their defaults (below)."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)  # the client ("": none); vLLM ignores it

    # OpenAI's and vLLM's fields (vllm/entrypoints/openai/completion/protocol.py, chat_completion/protocol.py)
    # that clients send at their defaults: accepted at a value that asks for nothing, refused by name otherwise.
    # (vLLM accepts them all, and any unknown field with a log line; minivllm refuses fields it does not know.)
    echo: NoOp(False) = None  # completions' echo needs prompt logprobs
    logit_bias: NoOp({}) = None
    response_format: NoOp({"type": "text"}) = None
    structured_outputs: NoOp() = None
    use_beam_search: NoOp(False) = None
    length_penalty: NoOp(1) = None
    spaces_between_special_tokens: NoOp(True) = None
    truncate_prompt_tokens: NoOp() = None
    truncation_side: NoOp() = None
    allowed_token_ids: NoOp() = None
    bad_words: NoOp([]) = None
    prompt_logprobs: NoOp() = None
    logprob_token_ids: NoOp() = None
    priority: NoOp(0) = None  # vLLM's default scheduling policy, fcfs, is minivllm's only one
    request_id: NoOp(kinds=(str,)) = None
    session_id: NoOp(kinds=(str,)) = None
    metadata: NoOp(kinds=(dict,)) = None
    store: NoOp(False) = None
    service_tier: NoOp("auto", "default") = None
    return_tokens_as_token_ids: NoOp(False) = None
    return_token_ids: NoOp(False) = None
    return_token_offsets: NoOp(False) = None
    return_weight_versions: NoOp(False) = None
    kv_transfer_params: NoOp() = None
    ec_transfer_params: NoOp() = None
    vllm_xargs: NoOp({}) = None
    repetition_detection: NoOp() = None
    thinking_token_budget: NoOp(-1) = None
    stream_interval: NoOp(1) = None
    watermarking: NoOp(False) = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions: a prompt as text or token ids, or a list of them (a batch: prompts x n choices)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (BOS) around a text prompt
    suffix: NoOp("") = None
    best_of: NoOp(1) = None
    prompt_embeds: NoOp() = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch, in order (one for a single prompt)."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: messages rendered through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: the rest of the context, as vLLM
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's: end the rendered chat with the assistant's turn
    add_special_tokens: NoOp(False) = None  # the chat template writes them
    tools: NoOp([]) = None
    tool_choice: NoOp("none") = None
    parallel_tool_calls: NoOp(True, False) = None  # nothing to call without tools
    functions: NoOp([]) = None
    function_call: NoOp("none") = None
    reasoning_effort: NoOp() = None
    include_reasoning: NoOp(True, False) = None  # no reasoning parser: nothing to include or strip
    modalities: NoOp(["text"]) = None
    audio: NoOp() = None
    prediction: NoOp() = None
    web_search_options: NoOp() = None
    chat_template: NoOp() = None
    chat_template_kwargs: NoOp({}) = None
    continue_final_message: NoOp(False) = None
    documents: NoOp() = None
    mm_processor_kwargs: NoOp({}) = None
    media_io_kwargs: NoOp({}) = None


class TokenizeRequest(OpenAIModel):
    """POST /tokenize, as vLLM's: a prompt, or messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    """The body as `model`, or a 400 naming the first wrong field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise APIError(400, *describe(error)) from None


def describe(error: ValidationError) -> tuple[str, str | None]:
    """A message and the top-level field it concerns, from pydantic's first error."""
    first = error.errors(include_url=False, include_input=False)[0]
    loc = [str(part) for part in first["loc"]]
    param = loc[0] if loc else None
    if first["type"] == "extra_forbidden":
        return f"not supported by minivllm: {'.'.join(loc)}", param
    if first["type"] == "value_error" and len(loc) == 1:  # a NoOp field, or a check of ours
        return f"{param}: {first['msg'].removeprefix('Value error, ')}", param
    if first["type"] == "json_invalid":
        return f"the body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}", None
    where = ".".join(part for part in loc if part not in ("str", "int", "float", "bool") and "[" not in part)
    return (f"{where}: {first['msg']}" if where else first["msg"]), param


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """The request's sampling fields as SamplingParams; a value out of range is a 400 naming the field."""
    fields = {name: getattr(request, name) for name in SAMPLING_FIELDS if getattr(request, name) is not None}
    if isinstance(request, ChatCompletionRequest):
        fields.pop("max_tokens", None)
        tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        fields["max_tokens"] = tokens  # None: until the end of the context
    elif request.max_tokens is None:
        fields["max_tokens"] = None
    fields["logprobs"] = num_logprobs(request)
    try:
        return SamplingParams(**fields)
    except ValueError as error:  # "SamplingParams.<field> = ...: must be ..."
        name = str(error).split(" ")[0].removeprefix("SamplingParams.")
        if name == "max_tokens" and isinstance(request, ChatCompletionRequest) \
                and request.max_completion_tokens is not None:
            name = "max_completion_tokens"
        raise APIError(400, str(error), name if name in SAMPLING_FIELDS or name in ("max_completion_tokens", "logprobs")
                       else None) from None


def num_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives per token the request wants, or None for no log-probabilities at all."""
    if isinstance(request, CompletionRequest):
        return request.logprobs
    if request.top_logprobs and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None
