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
