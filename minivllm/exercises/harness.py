"""What the exercises that run inside the engine share: transformers' greedy tokens (the ground truth), the first
place where two token lists part, an engine whose attention backend is the reader's, a name swapped for the
length of a check, and a speed report (the reader's code against the engine's own part, by CPU time)."""

from __future__ import annotations

import contextlib
import random
import time

import torch

from minivllm.exercises import note

GREEDY_PROMPTS = ["ROMEO:\n", "First Citizen:\nWe are accounted poor citizens, the patricians good.\n",
                  "To be, or not to be"]
GREEDY_TOKENS = 12
_HF_GREEDY: dict = {}
_HF_MODEL: list = []


def transformers_model():
    """transformers' copy of the embedded model (float32, eval), loaded once."""
    if not _HF_MODEL:
        from transformers import AutoModelForCausalLM
        from transformers.utils.logging import disable_progress_bar

        from minivllm.model.loader import DEFAULT_MODEL

        disable_progress_bar()
        _HF_MODEL.append(AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval())
    return _HF_MODEL[0]


def transformers_greedy(prompts, max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt (text or token ids), exactly max_tokens each."""
    key = (tuple(p if isinstance(p, str) else tuple(p) for p in prompts), max_tokens)
    if key not in _HF_GREEDY:
        from transformers import AutoTokenizer

        from minivllm.model.loader import DEFAULT_MODEL

        tokenizer, model, expected = AutoTokenizer.from_pretrained(DEFAULT_MODEL), transformers_model(), []
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids if isinstance(prompt, str) else torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            expected.append(out[0, ids.shape[1]:].tolist())
        _HF_GREEDY[key] = expected
    return _HF_GREEDY[key]


def first_divergence(got: list[list[int]], expected: list[list[int]], prompts) -> str | None:
    """'request i (prompt ...): token j is x, transformers says y' for the first request that differs."""
    for i, (tokens, want) in enumerate(zip(got, expected)):
        if list(tokens) != want:
            j = next((j for j, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))
            mine = tokens[j] if j < len(tokens) else "missing"
            shown = prompts[i][:24] if isinstance(prompts[i], str) else f"{len(prompts[i])} tokens"
            return (f"request {i} (prompt {shown!r}) diverged at generated token {j}: {mine}, "
                    f"transformers says {want[j] if j < len(want) else 'nothing more'}")
    return None


def engine_greedy_matches_transformers(backend) -> None:
    """A real LLM whose model runner attends with `backend` (a chapter 5 backend class with the reader's code in
    it) decodes GREEDY_PROMPTS greedily: every token must be transformers'."""
    from minivllm.entrypoints.llm import LLM
    from minivllm.exercises import expect
    from minivllm.sampling_params import SamplingParams

    llm = LLM(num_kv_blocks=32, attention_backend="torch", device="cpu")
    llm.engine.model_runner.backend = backend
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outputs = llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)
    problem = first_divergence([o.outputs[0].token_ids for o in outputs],
                               transformers_greedy(GREEDY_PROMPTS, GREEDY_TOKENS), GREEDY_PROMPTS)
    expect(problem is None, problem)


@contextlib.contextmanager
def swapped(module, name: str, value):
    """module.name is `value` inside the block (the engine part the reader's code replaces), itself again after."""
    previous = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, previous)


def report_speed(what: str, yours, reference, rounds: int = 3) -> None:
    """Time `yours` and `reference` (functions of no argument) in alternating rounds by this thread's CPU time, and
    report the better round of each and their ratio: a report, never a verdict (a shared machine moves it)."""
    best = {"yours": float("inf"), "reference": float("inf")}
    for _ in range(rounds):
        for name, run in (("yours", yours), ("reference", reference)):
            start = time.thread_time()
            run()
            best[name] = min(best[name], time.thread_time() - start)
    ratio = best["yours"] / max(best["reference"], 1e-9)
    note(f"speed ({what}): yours {1000 * best['yours']:.3g} ms, the engine's {1000 * best['reference']:.3g} ms "
         f"of CPU time, {ratio:.2f}x (a report, not a check)")


def paged_engine(config, prompts, max_tokens, shuffle_seed=None, manager_class=None, n=1):
    """A greedy LLMEngine on the embedded model with `prompts` queued (n samples each, `max_tokens` new tokens: one
    number, or one per prompt); its free blocks shuffled by
    `shuffle_seed` (so that a request's logical block i is not physical block i), its manager's class swapped."""
    from collections import OrderedDict

    from minivllm.book.mechanism_checks import tiny_model
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import SamplingParams

    model, tokenizer, _ = tiny_model()
    engine = LLMEngine(model, tokenizer, config)
    if manager_class is not None:
        engine.kv_manager.__class__ = manager_class
    if shuffle_seed is not None:
        pool = engine.kv_manager.pool
        order = list(pool.free_queue)
        random.Random(shuffle_seed).shuffle(order)
        pool.free_queue = OrderedDict.fromkeys(order)
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True, n=n))
    return engine


def step_engine(engine) -> None:
    """One engine step; a failure in the reader's code inside the forward pass is raised as itself."""
    from minivllm.engine.llm_engine import EngineStepError

    try:
        engine.step()
    except EngineStepError as error:
        raise error.__cause__ from None


def expect_transformers_tokens(engine, prompts, max_tokens, hint="") -> None:
    """Every request i of `engine` (its id str(i)) generated transformers' greedy tokens for prompts[i]."""
    from minivllm.book.mechanism_checks import divergence, greedy_reference
    from minivllm.exercises import expect

    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        for j, sample in enumerate(engine.output(str(i)).outputs):
            where = divergence(list(sample.token_ids), greedy_reference(prompt, budget))
            expect(where is None, f"request {i} ({len(prompt)} prompt tokens), sample {j}: {where}{hint}")


def expect_blocks_back(engine) -> None:
    from minivllm.exercises import expect

    pool = engine.kv_manager.pool
    expect(pool.num_free == pool.num_blocks and not any(pool.ref_counts),
           f"after the run, {pool.num_blocks - pool.num_free} of {pool.num_blocks} blocks are still held")
