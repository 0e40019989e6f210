"""The pieces of a response body (chapter 10's plumbing, as vLLM's `completion/serving.py` and
`chat_completion/serving.py` build them): a choice, its log-probabilities in the completions and the chat
formats, `stop_reason`, usage, and one server-sent event.

Choices of a batch are indexed as vLLM indexes them: prompt i's choice j is `i * n + j`.
"""

from __future__ import annotations

import asyncio
import json


class Responses:
    """Builds choices for one tokenizer (None: a model without one; tokens are shown as `token_id:N`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = None if tokenizer is None else tokenizer.eos_token_id
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text  # at most the vocabulary
        return text

    def choice(self, index: int, chat: bool, streaming: bool, text: str, token_ids, logprobs, offset: int) -> dict:
        if chat:
            body = {"delta": {"content": text}} if streaming else {"message": {"role": "assistant", "content": text}}
        else:
            body = {"text": text}
        body["index"] = index
        body["logprobs"] = None if logprobs is None else (
            self.chat_logprobs(token_ids, logprobs) if chat else self.completion_logprobs(token_ids, logprobs, offset))
        return body

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

    def stop_reason(self, completion, params) -> int | str | None:
        """vLLM's `stop_reason`: the stop token id (from `stop_token_ids`) or the stop string that ended the
        choice; None when it ended otherwise, at EOS included (vllm/v1/core/sched/utils.py `check_stop`,
        vllm/v1/engine/detokenizer.py). The engine reports only `finish_reason`, so this reads it back from
        the output: the last token, or which stop string the text ends with (or is cut before)."""
        if completion.finish_reason != "stop" or not completion.token_ids:
            return None
        last = completion.token_ids[-1]
        if last == self.eos_token_id and not params.ignore_eos:
            return None
        if last in params.stop_token_ids:
            return last
        if not params.stop_strings or self.tokenizer is None:
            return None
        text = completion.text
        if params.include_stop_str_in_output:  # the text ends with it; the engine took the earliest, then the least
            hits = [(len(text) - len(s), s) for s in params.stop_strings if text.endswith(s)]
        else:  # the text is cut just before it
            full = self.tokenizer.decode(completion.token_ids, skip_special_tokens=params.skip_special_tokens)
            hits = [(0, s) for s in params.stop_strings if full.startswith(s, len(text))]
        return min(hits)[1] if hits else None


def usage(outputs, details: bool = False) -> dict:
    """Usage over a request's outputs (one per prompt): prompt and completion tokens, and, only when the server
    was started with `enable_prompt_tokens_details` (vLLM's --enable-prompt-tokens-details,
    vllm/entrypoints/common/cli_args.py; off by default, when vLLM sends null), the prompt tokens served from
    the prefix cache (summed over the prompts; vLLM reports the last prompt's). Off, no client learns whether
    another's prompt is cached."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = {"cached_tokens": sum(o.num_cached_tokens for o in outputs)} if details else None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": cached}


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """`stream_options.continuous_usage_stats`: a chunk's usage, its prompt and its choice's tokens so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def merged(streams):
    """(i, item) from several async iterators, each item as it comes (vLLM's `merge_async_iterators`).
    Closing it, or an exception from one of them, cancels and closes them all."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
