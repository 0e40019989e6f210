"""The checks behind `SamplingParams` (chapter 1): plumbing, not taught. Every field is checked for its type
and range when the parameters are made, so that a bad value is refused with a ValueError naming the field,
before any work is done. The upper bounds keep every value within what the engine's tensors and Python's
own conversions hold, and keep one request from asking for unbounded work:

| field | accepted |
|---|---|
| n | 1 .. 4,096 samples |
| temperature | a finite number >= 0 |
| top_p | (0, 1]; min_p: [0, 1] |
| top_k | -1, 0 (all), or 1 .. 2**31 - 1 |
| seed | None, or 0 .. 2**63 - 1 |
| max_tokens | None, or 1 .. 2**31 - 1 |
| stop | None, or up to 32 non-empty strings of at most 1,024 characters |
| stop_token_ids | None, or up to 1,024 integers in 0 .. 2**31 - 1 |
| logprobs | None, or 0 .. 20 alternatives per token (vLLM's default --max-logprobs) |
| presence_penalty, frequency_penalty | a number in [-2, 2] (vLLM's and OpenAI's range) |
| repetition_penalty | a finite number > 0, at most 2**31 (1: off) |
| min_tokens | 0 .. 2**31 - 1, and at most max_tokens |
"""

import math

MAX_N = 4096
MAX_INT32 = 2**31 - 1
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # bool is an int to Python, not a parameter


def _number(x) -> bool:
    """A finite JSON or Python number."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an integer beyond any float, like 2**1024
        return False


def _show(value) -> str:
    """The value, for an error message: huge integers and long strings shortened (repr of an int of more
    than 4,300 digits raises)."""
    if _integer(value) and abs(value) > 10**30:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value) if not isinstance(value, (list, tuple)) or len(value) <= 8 else f"{len(value)} items"
    return text if len(text) <= 80 else text[:77] + "..."


def _stop_ok(stop) -> bool:
    if stop is None:
        return True
    strings = [stop] if isinstance(stop, str) else stop
    return (isinstance(strings, (list, tuple)) and len(strings) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in strings))


def _stop_ids_ok(ids) -> bool:
    return ids is None or (isinstance(ids, (list, tuple)) and len(ids) <= MAX_STOP_TOKEN_IDS
                           and all(_integer(t) and 0 <= t <= MAX_INT32 for t in ids))


def check_sampling_params(p) -> None:
    checks = [  # each condition checks the type first, so a wrong type is refused like a wrong value
        ("n", p.n, _integer(p.n) and 1 <= p.n <= MAX_N, f"an integer in [1, {MAX_N}]"),
        ("temperature", p.temperature, _number(p.temperature) and p.temperature >= 0, "a finite number >= 0"),
        ("top_p", p.top_p, _number(p.top_p) and 0 < p.top_p <= 1, "in (0, 1]"),
        ("top_k", p.top_k, _integer(p.top_k) and -1 <= p.top_k <= MAX_INT32, "-1, 0 (all) or an integer in [1, 2**31)"),
        ("min_p", p.min_p, _number(p.min_p) and 0 <= p.min_p <= 1, "in [0, 1]"),
        ("seed", p.seed, p.seed is None or (_integer(p.seed) and 0 <= p.seed < 2**63), "None or an integer in [0, 2**63)"),
        ("max_tokens", p.max_tokens, p.max_tokens is None or (_integer(p.max_tokens) and 1 <= p.max_tokens <= MAX_INT32),
         "None or an integer in [1, 2**31)"),
        ("stop", p.stop, _stop_ok(p.stop),
         f"None, or at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_STRING_CHARS} characters"),
        ("stop_token_ids", p.stop_token_ids, _stop_ids_ok(p.stop_token_ids),
         f"None, or at most {MAX_STOP_TOKEN_IDS} integers in [0, 2**31)"),
        ("logprobs", p.logprobs, p.logprobs is None or (_integer(p.logprobs) and 0 <= p.logprobs <= MAX_LOGPROBS),
         f"None or an integer in [0, {MAX_LOGPROBS}]"),
        ("presence_penalty", p.presence_penalty, _number(p.presence_penalty) and -2 <= p.presence_penalty <= 2,
         "a number in [-2, 2]"),
        ("frequency_penalty", p.frequency_penalty, _number(p.frequency_penalty) and -2 <= p.frequency_penalty <= 2,
         "a number in [-2, 2]"),
        ("repetition_penalty", p.repetition_penalty,
         _number(p.repetition_penalty) and 0 < p.repetition_penalty <= MAX_INT32 + 1, "a finite number > 0, at most 2**31"),
        ("min_tokens", p.min_tokens, _integer(p.min_tokens) and 0 <= p.min_tokens <= MAX_INT32,
         "an integer in [0, 2**31)"),
    ] + [(name, getattr(p, name), isinstance(getattr(p, name), bool), "True or False")
         for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")]
    for name, value, ok, expected in checks:
        if not ok:
            raise ValueError(f"SamplingParams.{name} = {_show(value)}: must be {expected}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(f"SamplingParams.min_tokens = {p.min_tokens}: must be at most max_tokens = {p.max_tokens}")
