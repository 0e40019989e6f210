"""Chapter 6 exercises."""

import random
from dataclasses import dataclass

from minivllm.exercises import CheckFailed, case_random, exercise, expect


def _reference_plan(running_behind, waiting_behind, budget, max_num_seqs):
    running = []
    for behind in running_behind:
        take = min(behind, budget)
        running.append(take)
        budget -= take
    waiting, seats = [], max_num_seqs - len(running_behind)
    for behind in waiting_behind:
        if budget == 0 or seats == 0:
            break
        take = min(behind, budget)
        waiting.append(take)
        budget -= take
        seats -= 1
    return running, waiting + [0] * (len(waiting_behind) - len(waiting))


@exercise("06.plan")
def _plan():
    rng = case_random("06.plan")
    random_cases = [([rng.choice([1, 1, 1, rng.randrange(2, 60)]) for _ in range(rng.randrange(0, 6))],
                     [rng.randrange(1, 80) for _ in range(rng.randrange(0, 5))], rng.randrange(1, 64),
                     rng.randrange(5, 9)) for _ in range(20)]
    def case(running, waiting, budget, seqs, what):
        def test(plan):
            got = plan(list(running), list(waiting), budget, seqs)
            want = _reference_plan(running, waiting, budget, seqs)
            got = (list(got[0]), list(got[1])) if isinstance(got, tuple) and len(got) == 2 else got
            expect(got == want, f"plan({running}, {waiting}, {budget}, {seqs}) = {got}, expected {want} ({what})")
        return test

    return [
        ("decodes only", case([1, 1, 1], [], 16, 8, "each running request gets its token")),
        ("decodes first, then a prefill that fits", case([1, 1], [10], 16, 8, "")),
        ("a long prompt is chunked to the budget left", case([1, 1, 1], [100, 5], 32, 8, "29 tokens, then nothing")),
        ("max_num_seqs stops admissions", case([1, 1], [3, 3, 3], 64, 3, "one seat left")),
        ("a running prefill chunk continues first", case([50, 1], [20], 40, 8, "")),
        ("no budget left for waiting requests", case([1] * 8, [4], 8, 16, "")),
        *[(f"random case {i}", case(*draw, "random")) for i, draw in enumerate(random_cases)],
    ]


class _ReaderPicksTheVictim(list):
    """A scheduler's running list whose `[-1]`, the one place Scheduler.schedule picks a preemption victim, asks
    the reader's preemption_victim (the running requests shuffled) and logs its pick beside the engine's own."""

    def __init__(self, requests, pick, rng, picks: list):
        super().__init__(requests)
        self.pick, self.rng, self.picks = pick, rng, picks

    def __getitem__(self, index):
        if index != -1:
            return super().__getitem__(index)
        own = super().__getitem__(-1)
        if self.pick is None:
            return own
        offered = self.rng.sample(list(self), len(self))
        chosen = self.pick(offered)
        expect(any(chosen is r for r in self), f"preemption_victim returned {chosen!r}, not one of the running "
                                               f"requests {[r.request_id for r in self]}")
        self.picks.append((chosen.request_id, own.request_id))
        return chosen


def _victim_scheduler():
    """A Scheduler that numbers its admissions: `request.admitted_at` is 1 for the first request it starts, 2 for
    the next, and a request readmitted after a preemption gets a new number."""
    from minivllm.core.scheduler import Scheduler

    class NumberingScheduler(Scheduler):
        num_admissions = 0

        def _start(self, request, num_computed):
            self.num_admissions += 1
            request.admitted_at = self.num_admissions
            super()._start(request, num_computed)
    return NumberingScheduler


@exercise("06.preemption_order")
def _preemption_order():
    """The reader's preemption_victim(running) picks every victim inside a real Scheduler (its running requests
    offered in a shuffled order), while an engine with the engine's own pick runs side by side on the same
    requests: per step the same victims, no admission in a step that preempted; the tokens are transformers'."""
    from minivllm.book.mechanism_checks import passage_prompts
    from minivllm.config import EngineConfig
    from minivllm.exercises.harness import expect_blocks_back, expect_transformers_tokens, paged_engine, step_engine

    def case(lengths, max_tokens, blocks, budget, seqs, seed, n=1):
        def test(preemption_victim):
            prompts, picks = passage_prompts(lengths), []
            config = EngineConfig(block_size=4, num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=budget)
            engines = []
            for pick in (preemption_victim, None):
                engine = paged_engine(config, prompts, max_tokens, n=n)
                engine.scheduler.__class__ = _victim_scheduler()
                engine.scheduler.running = _ReaderPicksTheVictim([], pick, random.Random(seed), picks)
                engines.append(engine)
            mine, reference = engines
            step = 0
            while reference.has_unfinished_requests() or mine.has_unfinished_requests():
                step += 1
                expect(step < 500, "no end after 500 steps")
                running = [r.request_id for r in mine.scheduler.running]
                try:
                    step_engine(mine)
                except (CheckFailed, NotImplementedError):
                    raise
                except Exception as error:
                    wrong = next(((a, b) for a, b in picks if a != b), ("?", "?"))
                    raise CheckFailed(f"step {step}: you picked {wrong[0]} where the engine picks {wrong[1]}, and "
                                      f"then the step failed ({type(error).__name__}: {error}): a request already "
                                      f"scheduled in this step was preempted") from None
                reference.step()
                got, want = ([r.request_id for r in e.last_schedule.preempted] for e in engines)
                if got != want:
                    wrong = next(((a, b) for a, b in picks if a != b), None)
                    detail = f": you picked {wrong[0]} where the engine picks {wrong[1]}" if wrong else ""
                    raise CheckFailed(f"step {step}: preempted {got}, the engine's scheduler preempts {want} "
                                      f"(running were {running}){detail}")
                admitted = [r.request_id for r, _ in mine.last_schedule.scheduled if r.request_id not in running]
                expect(not (got and admitted), f"step {step}: preempted {got} and admitted {admitted}")
            expect_transformers_tokens(mine, prompts, max_tokens)
            expect_blocks_back(mine)
            expect(picks, f"{blocks} blocks of 4: nothing was preempted, so the case proved nothing")
        return test

    rng = case_random("06.preemption_order")
    drawn = [rng.randrange(6, 24) for _ in range(rng.randrange(3, 6))]
    return [
        ("four requests admitted in one step, 12 blocks of 4", case([14, 9, 12, 7], 10, 12, 64, 4, 1)),
        ("a preempted request comes back, and one admitted after it is newer", case([12, 5, 9, 7, 14], 12, 12, 20,
                                                                                     4, 2)),
        ("3 samples each, 2 seats per request: a sample passed over for its share, admitted late, is the newest",
         case([6, 9], [4, 16], 10, 32, 4, 3, n=3)),
        (f"random: prompts of {drawn} tokens in 14 blocks of 4", case(drawn, 10, 14, rng.randrange(12, 40), 4,
                                                                     rng.randrange(10**6))),
    ]


@dataclass
class _Step:
    """What one call of schedule() did: the ids it scheduled (with token counts) and preempted, in order,
    and which requests were running when the step began."""
    scheduled: list[tuple[str, int]]
    preempted: list[str]
    running_before: list[str]
    chunked: bool  # some request got fewer tokens than it is behind


def _recording_scheduler(steps: list[_Step], schedule=None):
    """A Scheduler subclass that logs every step, running `schedule(self)` (the reader's) instead of its own."""
    from minivllm.core.scheduler import Scheduler

    class RecordingScheduler(Scheduler):
        def schedule(self):
            before = [r.request_id for r in self.running]
            out = super().schedule() if schedule is None else schedule(self)
            if schedule is not None:  # the reader's policy; the runner's part of the output is the engine's
                out = self.complete_output(out.scheduled, out.preempted)
            steps.append(_Step([(r.request_id, n) for r, n in out.scheduled], [r.request_id for r in out.preempted],
                               before, any(n < r.num_tokens - r.num_computed_tokens for r, n in out.scheduled)))
            if schedule is not None:
                _expect_limits(self, out)
            return out
    return RecordingScheduler


def _expect_limits(scheduler, out) -> None:
    total = sum(n for _, n in out.scheduled)
    expect(total <= scheduler.max_num_batched_tokens,
           f"a step scheduled {total} tokens, over the budget of {scheduler.max_num_batched_tokens}")
    expect(len(scheduler.running) <= scheduler.max_num_seqs,
           f"{len(scheduler.running)} requests running, over max_num_seqs = {scheduler.max_num_seqs}")
    ids = [r.request_id for r, _ in out.scheduled]
    expect(len(ids) == len(set(ids)), f"a request scheduled twice in one step: {ids}")
    for request, n in out.scheduled:
        expect(request.status == "running" and n > 0,
               f"request {request.request_id} scheduled with {n} tokens, status {request.status!r}")


def _policy_problem(k: int, mine: _Step, ref: _Step) -> str | None:
    """Where the reader's step k leaves the engine's policy, named by the rule it breaks."""
    order = [rid for rid, _ in mine.scheduled]
    admitted = [rid for rid in order if rid not in mine.running_before]
    first_admitted = order.index(admitted[0]) if admitted else len(order)
    late = [rid for rid in order[first_admitted:] if rid in mine.running_before]
    if late:
        return (f"step {k}: waiting request {admitted[0]} was served before running request {late[0]} "
                f"(running requests come first)")
    starved = [rid for rid, _ in ref.scheduled if rid in mine.running_before and rid not in order
               and rid not in mine.preempted]
    if admitted and starved:
        return (f"step {k}: admitted waiting request {admitted[0]} while running request {starved[0]} got nothing "
                f"(running requests come first)")
    if mine.preempted and admitted:
        return f"step {k}: preempted {mine.preempted}, then admitted {admitted} in the same step"
    if mine.preempted != ref.preempted:
        return (f"step {k}: preempted {mine.preempted}, the engine's scheduler preempts {ref.preempted} "
                f"(the newest running request first; running were {mine.running_before})")
    if mine.scheduled != ref.scheduled:
        return f"step {k}: scheduled {mine.scheduled}, the engine's scheduler schedules {ref.scheduled}"
    return None


@exercise("06.schedule")
def _schedule():
    """The reader's schedule(scheduler) -> SchedulerOutput replaces Scheduler.schedule in a real LLMEngine that
    runs side by side with an engine keeping its own Scheduler, on the same requests: step for step, the same
    requests in the same order, the same preemption victims, then the same tokens and every block back."""
    from minivllm.book.mechanism_checks import passage_prompts, tiny_model
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import SamplingParams

    def engine(prompts, max_tokens, config, scheduler_class):
        model, tokenizer, _ = tiny_model()
        built = LLMEngine(model, tokenizer, config)
        built.scheduler.__class__ = scheduler_class  # the engine's scheduler, as configured, recording its steps
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            built.add_request(str(i), prompt, params)
        return built

    def case(lengths, max_tokens, blocks, budget, seqs, preempts, max_steps=400):
        def test(schedule):
            prompts, mine, ref = passage_prompts(lengths), [], []
            config = EngineConfig(block_size=4, num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=budget)
            reader = engine(prompts, max_tokens, config, _recording_scheduler(mine, schedule))
            reference = engine(prompts, max_tokens, config, _recording_scheduler(ref))
            for k in range(max_steps):
                if not reference.has_unfinished_requests():
                    break
                reference.step()
                reader.step()
                problem = _policy_problem(k, mine[-1], ref[-1])
                expect(problem is None, problem)
            expect(not reader.has_unfinished_requests(), "the engine's scheduler finished every request, yours did "
                                                         f"not: {[r.request_id for r in reader.scheduler.waiting]}")
            for i in range(len(prompts)):
                got, want = (list(e.output(str(i)).outputs[0].token_ids) for e in (reader, reference))
                expect(got == want, f"request {i}: tokens {got}, the engine's own scheduler gives {want}")
            pool = reader.kv_manager.pool
            expect(pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} blocks held after the end")
            expect(any(step.chunked for step in ref),
                   f"no prompt was chunked under a budget of {budget}, so the case proved nothing")
            expect(not preempts or reader.scheduler.num_preemptions > 0,
                   f"{blocks} blocks of 4 cannot hold every request at once, yet nothing was preempted")
        return test

    return [
        ("memory pressure: 40 blocks of 4 tokens, preemption", case([40, 23, 57, 9, 31, 48], 12, 40, 24, 4, True)),
        ("decodes and prefill chunks under a 16-token budget", case([40, 23, 57, 9], 6, 200, 16, 8, False)),
        ("two seats for five requests", case([30, 12, 45, 8, 20], 6, 200, 24, 2, False)),
    ]
