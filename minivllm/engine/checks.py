"""The engine's input checks: plumbing, not taught. Every one runs before any work is done, so a bad
request or configuration is refused with a message naming what is wrong, and nothing else is disturbed."""

from minivllm.sampling_params import SamplingParams


def check_engine_config(model, config) -> int:
    """Refuse an engine configuration that cannot serve; returns the effective max_model_len."""
    capacity = config.num_kv_blocks * config.block_size
    max_model_len = config.max_model_len or min(model.config.max_model_len, capacity)
    checks = [("max_model_len", max_model_len, 2 <= max_model_len <= min(model.config.max_model_len, capacity),
               f"between 2 and min(the model's {model.config.max_model_len}, the KV cache's {capacity} slots)"),
              ("max_num_seqs", config.max_num_seqs, config.max_num_seqs >= 1, ">= 1"),
              ("max_num_batched_tokens", config.max_num_batched_tokens, config.max_num_batched_tokens >= 1, ">= 1"),
              ("max_request_share", config.max_request_share,
               isinstance(config.max_request_share, (int, float)) and 0 < config.max_request_share <= 1, "in (0, 1]"),
              ("long_prefill_token_threshold", config.long_prefill_token_threshold,
               isinstance(config.long_prefill_token_threshold, int) and config.long_prefill_token_threshold >= 0,
               "an integer >= 0 (0: no cap)"),
              ("scheduler_reserve_full_isl", config.scheduler_reserve_full_isl,
               isinstance(config.scheduler_reserve_full_isl, bool), "True or False")]
    if not config.enable_chunked_prefill:
        checks.append(("max_num_batched_tokens", config.max_num_batched_tokens,
                       config.max_num_batched_tokens >= max_model_len,
                       f">= max_model_len ({max_model_len}) without chunked prefill, or long prompts never run"))
    for name, value, ok, expected in checks:
        if not ok:
            raise ValueError(f"{name} = {value}: must be {expected}")
    return max_model_len


def check_request(engine, request_id: str, prompt_token_ids, params, cache_salt=None) -> None:
    """Refuse a request the engine cannot serve."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
    if request_id in engine.output_processor.parents:
        raise ValueError(f"request_id {request_id!r} is already in use")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string or None, not {type(cache_salt).__name__}")
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        raise ValueError("prompt is empty: the model needs at least one token to condition on")
    vocab = engine.model.config.vocab_size
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
    if bad:
        raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
    if len(prompt_token_ids) >= engine.config.max_model_len:
        raise ValueError(f"prompt of {len(prompt_token_ids)} tokens: must be shorter than max_model_len = "
                         f"{engine.config.max_model_len}, to leave room for at least one new token")
    check_params_against_model(params, vocab, engine.config.max_model_len - len(prompt_token_ids))
    if params.stop_strings and engine.tokenizer is None:
        raise ValueError("SamplingParams.stop needs a tokenizer: stop strings are matched on text")


def check_params_against_model(params: SamplingParams, vocab: int, room: int) -> None:
    """The fields SamplingParams checked only for their own range, checked against this model: every token id
    inside its vocabulary, and lengths within the room the prompt leaves (`room` new tokens at most). A value
    that passed here cannot fail inside the sampler, where it would cost every request of the step."""
    outside = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if outside:
        raise ValueError(f"SamplingParams.stop_token_ids: {outside[:5]} outside this model's vocabulary [0, {vocab})")
    if params.logprobs is not None and params.logprobs > vocab:
        raise ValueError(f"SamplingParams.logprobs = {params.logprobs}: more alternatives than this model's "
                         f"{vocab} tokens")
    if params.min_tokens > room:
        raise ValueError(f"SamplingParams.min_tokens = {params.min_tokens}: the prompt leaves room for at most "
                         f"{room} new tokens within max_model_len")


def check_async_options(client_share, stall_timeout) -> None:
    """AsyncLLM's options (chapter 10): a client's share of the engine, and the longest a turn may take."""
    number = lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)  # noqa: E731
    if not (number(client_share) and 0 < client_share <= 1):
        raise ValueError(f"client_share = {client_share!r}: must be in (0, 1], the share of max_num_seqs and of "
                         "max_num_batched_tokens that one client's requests may hold")
    if not (number(stall_timeout) and 0 < stall_timeout < float("inf")):
        raise ValueError(f"stall_timeout = {stall_timeout!r}: must be a number of seconds > 0")
