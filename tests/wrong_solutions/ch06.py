"""Wrong answers to chapter 6's exercises."""

import time

from minivllm.core.scheduler import SchedulerOutput


def plan_waiting_first(running_behind, waiting_behind, budget, max_num_seqs):
    waiting = []
    for behind in waiting_behind:
        waiting.append(min(behind, budget))
        budget -= waiting[-1]
    running = []
    for behind in running_behind:
        running.append(min(behind, budget))
        budget -= running[-1]
    return running, waiting


def plan_seats_ignore_running(running_behind, waiting_behind, budget, max_num_seqs):
    running = []
    for behind in running_behind:
        running.append(min(behind, budget))
        budget -= running[-1]
    waiting, seats = [0] * len(waiting_behind), max_num_seqs
    for i, behind in enumerate(waiting_behind):
        if budget == 0 or seats == 0:
            break
        waiting[i] = min(behind, budget)
        budget -= waiting[i]
        seats -= 1
    return running, waiting


def plan_no_chunking(running_behind, waiting_behind, budget, max_num_seqs):
    running = []
    for behind in running_behind:
        running.append(min(behind, budget))
        budget -= running[-1]
    waiting, seats = [0] * len(waiting_behind), max_num_seqs - len(running_behind)
    for i, behind in enumerate(waiting_behind):
        if behind > budget or seats == 0:
            break
        waiting[i] = behind
        budget -= behind
        seats -= 1
    return running, waiting


def preemption_oldest_first(running):
    return min(running, key=lambda r: r.admitted_at)


def preemption_latest_arrival(running):  # a request readmitted after preemption arrived early, yet is the newest
    return max(running, key=lambda r: r.arrival_time)


def preemption_last_offered(running):  # the list is not in the scheduler's order
    return running[-1]


def preemption_the_most_preempted(running):  # "it has lost its work before, so it is cheap to lose again"
    return max(running, key=lambda r: (r.num_preemptions, r.admitted_at))


def _scheduler(waiting_first=False, preempt_oldest=False, admit_after_preemption=False, whole_prompt_gate=True):
    """Chapter 6's scheduler with one of its rules broken. Under vLLM 0.33's full-prompt admission (the gate),
    nothing fits right after a preemption, so admitting in such a step shows only without the gate."""
    def admit(scheduler, budget, scheduled, preempted):
        while scheduler.waiting and (admit_after_preemption or not preempted) \
                and len(scheduler.running) < scheduler.max_num_seqs and budget > 0:
            request = scheduler.waiting[0]
            blocks, num_computed = scheduler.kv_manager.get_computed_blocks(request)
            num_new = scheduler._tokens_to_compute(request, budget, num_computed)
            fits_whole = getattr(scheduler, "_fits_whole", None) if whole_prompt_gate else None
            fits_whole = fits_whole or (lambda *args: True)  # the engine's admission rule, if it has one
            if num_new == 0 or not fits_whole(request, blocks) \
                    or not scheduler.kv_manager.allocate_slots(request, num_new, blocks):
                break
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
            scheduler.waiting.popleft()
            request.status = "running"
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
            scheduler.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return budget

    def schedule(scheduler):
        budget, scheduled, preempted = scheduler.max_num_batched_tokens, [], []
        if waiting_first:
            budget = admit(scheduler, budget, scheduled, preempted)
        newly = {id(r) for r, _ in scheduled}
        for request in list(scheduler.running):
            if request.status != "running" or id(request) in newly:
                continue
            num_new = scheduler._tokens_to_compute(request, budget, request.num_computed_tokens)
            if num_new == 0:
                continue
            while not scheduler.kv_manager.allocate_slots(request, num_new):
                victim = scheduler.running[0 if preempt_oldest else -1]
                scheduler._preempt(victim)
                preempted.append(victim)
                scheduled[:] = [(r, n) for r, n in scheduled if r is not victim]
                if victim is request:
                    break
            if request.status == "running":
                scheduled.append((request, num_new))
                budget -= num_new
        if not waiting_first:
            admit(scheduler, budget, scheduled, preempted)
        return SchedulerOutput(scheduled, preempted)
    return schedule


def _named(schedule, name):
    schedule.__name__ = schedule.__qualname__ = name
    return schedule


schedule_waiting_first = _named(_scheduler(waiting_first=True), "schedule_waiting_first")
schedule_preempts_oldest = _named(_scheduler(preempt_oldest=True), "schedule_preempts_oldest")
schedule_admits_after_preemption = _named(_scheduler(admit_after_preemption=True, whole_prompt_gate=False),
                                          "schedule_admits_after_preemption")
schedule_admits_by_chunk = _named(_scheduler(whole_prompt_gate=False),  # chapter 6's policy before vLLM 0.33
                                  "schedule_admits_by_chunk")

WRONG = {
    "06.plan": [plan_waiting_first, plan_seats_ignore_running, plan_no_chunking],
    "06.preemption_order": [preemption_oldest_first, preemption_latest_arrival, preemption_last_offered,
                            preemption_the_most_preempted],
    "06.schedule": [schedule_waiting_first, schedule_preempts_oldest, schedule_admits_after_preemption,
                    schedule_admits_by_chunk],
}

RUN_THE_MODEL = {"06.preemption_order"}
