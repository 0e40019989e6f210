"""Health means "can serve" (server plumbing, not taught). vLLM's `/health` (vllm/entrypoints/serve/instrumentator/
health.py) asks the engine client's `check_health()` (vllm/v1/engine/async_llm.py), which raises EngineDeadError
once the engine core has died: 503. Here the engine is in this process, so `engine_problem` looks at what can stop
it serving: a tensor-parallel worker that has exited, a tensor-parallel runner that refuses every step after an
earlier failure (`ModelRunner.broken`, chapter 11), an engine loop that ended on an exception, or a step that has not returned for longer than the AsyncLLM's
`stall_timeout` (vLLM bounds a step the same way, with VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s, in
vllm/v1/executor/multiproc_executor.py; past it the engine core dies). The step runs in a worker thread, so the
event loop answers `/health` meanwhile; a step that held the GIL throughout would leave `/health` unanswered,
which a prober (the data-parallel front end's) counts as a failure too.

`exit_when_dead` is vLLM's `watchdog_loop` / `terminate_if_errored` (vllm/entrypoints/launchers/launcher.py): a
server whose engine is dead stops, so that whoever supervises it (a data-parallel front end here) can start a
fresh one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

logger = logging.getLogger("minivllm.entrypoints.openai")


def engine_problem(async_llm) -> str | None:
    """Why this AsyncLLM's engine cannot serve any request, or None when it can. Cheap: no engine work."""
    engine = async_llm.engine
    broken = getattr(engine.model_runner, "broken", None)
    if broken:
        return broken
    workers = getattr(engine, "workers", None)
    if workers is not None:
        try:
            workers.check_alive()
        except RuntimeError as error:
            return str(error)
    started = async_llm.turn_started  # a turn in progress: requests are in the engine
    if started is not None and time.monotonic() - started > async_llm.stall_timeout:
        return (f"the engine stalled: one step has run for {time.monotonic() - started:.1f} s "
                f"(stall_timeout {async_llm.stall_timeout:g} s)")
    task = async_llm._loop_task
    if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
        return f"the engine loop stopped: {task.exception()!r}"
    return None


def exit_when_dead(server, async_llm, interval: float = 1.0,
                   hard_exit_after: float | None = None) -> threading.Thread:
    """A thread that asks uvicorn `server` to exit once `engine_problem` reports one (checked every `interval`
    seconds), logging why; `server.engine_death` says it afterwards. With `hard_exit_after`, a process still
    running that many seconds later ends with `os._exit(1)`: a stalled step holds a thread that no shutdown can
    stop (for a server process of its own, never a notebook's or a test's)."""
    server.engine_death = None

    def watch():
        while not server.should_exit:
            problem = engine_problem(async_llm)
            if problem is not None:
                server.engine_death = problem
                logger.error("the engine cannot serve (%s): stopping the server", problem)
                print(f"minivllm: the engine cannot serve ({problem}): stopping", file=sys.stderr, flush=True)
                server.should_exit = True
                if hard_exit_after is not None:
                    time.sleep(hard_exit_after)
                    print("minivllm: the server did not stop: exiting", file=sys.stderr, flush=True)
                    os._exit(1)
                return
            time.sleep(interval)

    thread = threading.Thread(target=watch, daemon=True, name="minivllm-engine-watchdog")
    thread.start()
    return thread
