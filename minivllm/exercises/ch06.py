"""Chapter 6 exercises."""

from minivllm.exercises import exercise, expect


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
    ]


@exercise("06.preemption_order")
def _preemption_order():
    def case(arrivals):
        def test(preemption_order):
            got = list(preemption_order(list(arrivals)))
            want = sorted(arrivals, reverse=True)
            expect(got == want, f"preemption_order({arrivals}) = {got}, expected {want}")
        return test

    return [
        ("already in arrival order", case([1.0, 2.0, 3.0])),
        ("any order", case([5.5, 0.1, 3.2, 4.0])),
        ("one request", case([7.0])),
    ]


@exercise("06.schedule")
def _schedule():
    """The reader's schedule(scheduler) -> SchedulerOutput replaces Scheduler.schedule in a real LLMEngine."""
    from minivllm.book.mechanism_checks import divergence, greedy_reference, passage_prompts, run_engine
    from minivllm.config import EngineConfig
    from minivllm.core.scheduler import Scheduler

    def scheduler_class(schedule, chunks):
        class ReaderScheduler(Scheduler):
            def schedule(self):
                out = schedule(self)
                total = sum(n for _, n in out.scheduled)
                expect(total <= self.max_num_batched_tokens,
                       f"a step scheduled {total} tokens, over the budget of {self.max_num_batched_tokens}")
                expect(len(self.running) <= self.max_num_seqs,
                       f"{len(self.running)} requests running, over max_num_seqs = {self.max_num_seqs}")
                ids = [r.request_id for r, _ in out.scheduled]
                expect(len(ids) == len(set(ids)), f"a request scheduled twice in one step: {ids}")
                for request, n in out.scheduled:
                    expect(request.status == "running" and n > 0,
                           f"request {request.request_id} scheduled with {n} tokens, status {request.status!r}")
                    chunks.append(n < request.num_tokens - request.num_computed_tokens)
                return out
        return ReaderScheduler

    def case(lengths, max_tokens, blocks, budget, seqs, preempts):
        def test(schedule):
            prompts, chunks = passage_prompts(lengths), []
            config = EngineConfig(block_size=4, num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=budget)
            engine, outputs = run_engine(prompts, max_tokens, config, scheduler_class(schedule, chunks))
            for i, prompt in enumerate(prompts):
                where = divergence(outputs[i], greedy_reference(prompt, max_tokens))
                expect(where is None, f"request {i} ({len(prompt)}-token prompt): {where}")
            pool = engine.kv_manager.pool
            expect(pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} blocks held after the end")
            expect(any(chunks), f"no prompt was chunked, yet prompts of {max(lengths)} tokens exceed the budget "
                                f"of {budget}")
            if preempts:
                expect(engine.scheduler.num_preemptions > 0,
                       f"{blocks} blocks of 4 cannot hold every request at once, yet nothing was preempted")
        return test

    return [
        ("decodes and prefill chunks under a 16-token budget", case([40, 23, 57, 9], 10, 200, 16, 8, False)),
        ("two seats for five requests", case([30, 12, 45, 8, 20], 8, 200, 24, 2, False)),
        ("memory pressure: 40 blocks of 4 tokens, preemption", case([40, 23, 57, 9, 31, 48], 16, 40, 24, 4, True)),
    ]
