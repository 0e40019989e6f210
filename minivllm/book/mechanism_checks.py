"""Shared pieces of the exercises that replace a real engine part (chapters 5-7): the embedded tiny model,
transformers' greedy tokens as the reference, prompts from the book's passages, and a report of the first
token where two sequences part."""

from __future__ import annotations

from functools import lru_cache

import torch

_REFERENCE: dict[tuple[tuple[int, ...], int], list[int]] = {}


@lru_cache(maxsize=1)
def tiny_model():
    """(minivllm model, tokenizer, transformers model) of the embedded checkpoint, on the CPU, loaded once."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from minivllm.model.loader import DEFAULT_MODEL, load_model

    model, tokenizer = load_model(None, device="cpu")
    bar = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    finally:
        if bar:
            logging.enable_progress_bar()
    return model, tokenizer, hf


def greedy_reference(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt_ids`: `max_tokens` argmax tokens, EOS not special."""
    key = (tuple(prompt_ids), max_tokens)
    if key not in _REFERENCE:
        hf = tiny_model()[2]
        ids = list(prompt_ids)
        with torch.no_grad():  # the whole sequence again each step: slow in general, instant for this model
            for _ in range(max_tokens):
                ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        out = ids[len(prompt_ids):]
        _REFERENCE[key] = out
    return list(_REFERENCE[key])


def passage_prompts(lengths: list[int], offset: int = 0) -> list[list[int]]:
    """Prompts of the given token lengths, cut from the book's Shakespeare passages (different starts)."""
    from minivllm.book.texts import CORPUS

    ids = tiny_model()[1].encode(CORPUS)
    return [ids[offset + 37 * i:offset + 37 * i + n] for i, n in enumerate(lengths)]


def divergence(got: list[int], want: list[int]) -> str | None:
    """None if equal, else where they part: 'step k: token a, expected b' (or a length difference)."""
    for step, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"step {step}: token {a}, expected {b}"
    if len(got) != len(want):
        return f"{len(got)} tokens, expected {len(want)}"
    return None


def run_engine(prompts: list[list[int]], max_tokens: int, config, scheduler_class=None, kv_manager=None,
               max_steps: int = 500, salts=None):
    """Greedy requests through an LLMEngine whose scheduler (a Scheduler subclass) or KV manager was swapped
    for the reader's. Returns (engine, {request index: output token ids}); raises if it stops making progress."""
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.exercises import CheckFailed
    from minivllm.sampling_params import SamplingParams

    model, tokenizer, _ = tiny_model()
    engine = LLMEngine(model, tokenizer, config)
    if kv_manager is not None:
        engine.kv_manager = engine.scheduler.kv_manager = kv_manager
    if scheduler_class is not None:
        engine.scheduler = scheduler_class(engine.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                           config.enable_chunked_prefill)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, cache_salt=None if salts is None else salts[i])
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    else:
        stuck = [r.request_id for r in list(engine.scheduler.running) + list(engine.scheduler.waiting)]
        pool = engine.kv_manager.pool
        raise CheckFailed(f"no end after {max_steps} steps: requests {stuck} never finished "
                          f"({pool.num_free} of {pool.num_blocks} blocks free, "
                          f"{engine.scheduler.num_preemptions} preemptions)")
    return engine, {i: list(engine.output(str(i)).outputs[0].token_ids) for i in range(len(prompts))}
