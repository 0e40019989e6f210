"""Health means "can serve" (server plumbing, not taught). vLLM's `/health` (vllm/entrypoints/serve/instrumentator/
health.py) asks the engine client's `check_health()` (vllm/v1/engine/async_llm.py), which raises EngineDeadError
once the engine core has died: 503. Here the engine is in this process, so `engine_problem` looks at what can stop
it serving: a tensor-parallel worker that has exited, a tensor-parallel runner that refuses every step after an
earlier failure (`TensorParallelRunner.broken`, chapter 11), or an engine loop that ended on an exception.

`exit_when_dead` is vLLM's `watchdog_loop` / `terminate_if_errored` (vllm/entrypoints/launchers/launcher.py): a
server whose engine is dead stops, so that whoever supervises it (a data-parallel front end here) can start a
fresh one.
"""

from __future__ import annotations

import logging
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
    task = async_llm._loop_task
    if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
        return f"the engine loop stopped: {task.exception()!r}"
    return None


def exit_when_dead(server, async_llm, interval: float = 1.0) -> threading.Thread:
    """A thread that asks uvicorn `server` to exit once `engine_problem` reports one (checked every `interval`
    seconds), logging why; `server.engine_death` says it afterwards."""
    server.engine_death = None

    def watch():
        while not server.should_exit:
            problem = engine_problem(async_llm)
            if problem is not None:
                server.engine_death = problem
                logger.error("the engine cannot serve (%s): stopping the server", problem)
                print(f"minivllm: the engine cannot serve ({problem}): stopping", file=sys.stderr, flush=True)
                server.should_exit = True
                return
            time.sleep(interval)

    thread = threading.Thread(target=watch, daemon=True, name="minivllm-engine-watchdog")
    thread.start()
    return thread
