"""The replica processes of a data-parallel server (chapter 12's plumbing, not taught): started together, each
announcing the URL it serves on (minivllm/entrypoints/openai/replica.py), stopped together, also when one fails
to start. A replica watches its parent and exits when it has gone, so a killed front end leaves no orphans.

**Restarts.** `supervise(on_restart)` starts a thread that restarts a replica whose process has exited (killed, or
stopped by its own watchdog because its engine is dead: minivllm/entrypoints/openai/health.py), at most
`max_restarts` times per replica, each attempt and each refusal logged (logger `minivllm.entrypoints.openai`);
`on_restart(rank, url)` tells the front end the new URL. vLLM's data-parallel supervisor
(vllm/entrypoints/launchers/dp_supervisor.py, `_monitor_children`) shuts every server down when one exits instead.
The replicas share one operator key (`operator_key`, random), the only key their `/kv_events` accepts.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import secrets
import subprocess
import sys
import threading
import time

import httpx

MAX_REPLICAS = 64
READY = re.compile(r"^minivllm replica (\d+) serving on (http://\S+)$")
logger = logging.getLogger("minivllm.entrypoints.openai")


def check_data_parallel_size(size) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_REPLICAS:
        raise ValueError(f"--data-parallel-size {size!r}: must be an integer from 1 to {MAX_REPLICAS}")


class Replicas:
    """N replica processes: started together, each announcing its URL; stopped together, also on failure."""

    def __init__(self, size: int, llm_kwargs: dict | None = None, model_name: str | list[str] = "minivllm",
                 api_key: str | None = None, threads: int | None = None, startup_timeout: float = 300,
                 dev_mode: bool = False, enable_prompt_tokens_details: bool = False, max_restarts: int = 3):
        check_data_parallel_size(size)
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise ValueError(f"max_restarts = {max_restarts!r}: a whole number, 0 or more")
        threads = threads or max(1, (os.cpu_count() or 1) // size)
        self.operator_key = secrets.token_urlsafe(32)
        self.env = {**os.environ, "TQDM_DISABLE": "1", "MINIVLLM_OPERATOR_KEY": self.operator_key}
        if api_key:
            self.env["MINIVLLM_API_KEY"] = api_key
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = [""] * size
        self.startup_timeout, self.max_restarts, self.restarts = startup_timeout, max_restarts, [0] * size
        self.lock, self.stopping, self.retired = threading.Lock(), threading.Event(), []
        names = [model_name] if isinstance(model_name, str) else list(model_name)
        self.argv = (["--parent", str(os.getpid()), "--served-model-name", *names, "--threads", str(threads),
                      "--llm-kwargs", json.dumps(llm_kwargs or {})] + (["--dev-mode"] if dev_mode else [])
                     + (["--enable-prompt-tokens-details"] if enable_prompt_tokens_details else []))
        try:
            for rank in range(size):
                self.processes.append(self._spawn(rank))
            deadline = time.monotonic() + startup_timeout
            for rank, process in enumerate(self.processes):
                self.urls[rank] = self._announced(rank, process, deadline)
            for url in self.urls:
                self._wait_healthy(url, deadline)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, rank: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "minivllm.entrypoints.openai.replica", "--rank", str(rank),
                                 *self.argv], stdout=subprocess.PIPE, stderr=None, text=True, env=self.env)

    def supervise(self, on_restart=None, interval: float = 0.2) -> threading.Thread:
        """Restart each replica whose process exits, at most `max_restarts` times each. The new URL replaces the
        old one in `urls` (the list the front end routes by); then `on_restart(rank, url)`, if given."""
        def watch():
            while not self.stopping.wait(interval):
                for rank, process in enumerate(self.processes):
                    if process.poll() is not None and not self.stopping.is_set():
                        self._restart(rank, process.returncode, on_restart)

        thread = threading.Thread(target=watch, daemon=True, name="minivllm-replica-supervisor")
        thread.start()
        return thread

    def _restart(self, rank: int, code: int, on_restart) -> None:
        if self.restarts[rank] >= self.max_restarts:
            if self.restarts[rank] == self.max_restarts:  # say it once
                self.restarts[rank] += 1
                logger.error("replica %d exited (code %s) after %d restarts: not restarting it again", rank, code,
                             self.max_restarts)
            return
        self.restarts[rank] += 1
        logger.warning("replica %d exited (code %s): restart %d of at most %d", rank, code, self.restarts[rank],
                       self.max_restarts)
        with self.lock:
            if self.stopping.is_set():
                return
            self.retired.append(self.processes[rank])  # its stdout is closed in stop(), after its reader has ended
            process = self.processes[rank] = self._spawn(rank)
        try:
            deadline = time.monotonic() + self.startup_timeout
            url = self._announced(rank, process, deadline)
            self._wait_healthy(url, deadline)
        except RuntimeError as error:  # it exits (or is killed below): the next turn counts another attempt
            if not self.stopping.is_set():
                logger.error("replica %d did not restart: %s", rank, error)
            if process.poll() is None:
                process.kill()
                process.wait()
            return
        self.urls[rank] = url
        logger.warning("replica %d restarted on %s", rank, url)
        if on_restart is not None:
            on_restart(rank, url)

    @staticmethod
    def _announced(rank: int, process: subprocess.Popen, deadline: float) -> str:
        """The URL the replica prints once its socket is bound; its later output is drained in a thread."""
        lines: queue.Queue = queue.Queue()

        def read():
            for line in process.stdout:
                lines.put(line)
            lines.put(None)  # it closed its stdout: it exited

        threading.Thread(target=read, daemon=True, name=f"minivllm-replica-{rank}-stdout").start()
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"replica {rank} did not announce its port in time") from None
            if line is None:
                raise RuntimeError(f"replica {rank} did not start (exit code {process.wait()}; see its error above)")
            match = READY.match(line.strip())
            if match:
                return match.group(2)

    @staticmethod
    def _wait_healthy(url: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the replica at {url} did not become healthy")

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout:
                process.stdout.close()
        for process in self.retired:
            if process.stdout:
                process.stdout.close()

