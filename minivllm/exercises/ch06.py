"""Chapter 6 exercises."""

from dataclasses import dataclass

from minivllm.exercises import case_random, exercise, expect


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


@exercise("06.preemption_order")
def _preemption_order():
    def case(arrivals):
        def test(preemption_order):
            got = list(preemption_order(list(arrivals)))
            want = sorted(arrivals, reverse=True)
            expect(got == want, f"preemption_order({arrivals}) = {got}, expected {want}")
        return test

    rng = case_random("06.preemption_order")
    return [
        ("already in arrival order", case([1.0, 2.0, 3.0])),
        ("any order", case([5.5, 0.1, 3.2, 4.0])),
        ("one request", case([7.0])),
        ("random arrival times", case([round(rng.uniform(0, 100), 3) for _ in range(rng.randrange(5, 12))])),
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
