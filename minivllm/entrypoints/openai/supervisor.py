"""The replica processes of a data-parallel server (chapter 12's plumbing, not taught): started together, each
announcing the URL it serves on (minivllm/entrypoints/openai/replica.py), stopped together, also when one fails
to start. A replica watches its parent and exits when it has gone, so a killed front end leaves no orphans."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import httpx

MAX_REPLICAS = 64
READY = re.compile(r"^minivllm replica (\d+) serving on (http://\S+)$")


def check_data_parallel_size(size) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_REPLICAS:
        raise ValueError(f"--data-parallel-size {size!r}: must be an integer from 1 to {MAX_REPLICAS}")


class Replicas:
    """N replica processes: started together, each announcing its URL; stopped together, also on failure."""

    def __init__(self, size: int, llm_kwargs: dict | None = None, model_name: str | list[str] = "minivllm",
                 api_key: str | None = None, threads: int | None = None, startup_timeout: float = 300,
                 dev_mode: bool = False):
        check_data_parallel_size(size)
        threads = threads or max(1, (os.cpu_count() or 1) // size)
        env = {**os.environ, "TQDM_DISABLE": "1"}
        if api_key:
            env["MINIVLLM_API_KEY"] = api_key
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = [""] * size
        names = [model_name] if isinstance(model_name, str) else list(model_name)
        try:
            for rank in range(size):
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "minivllm.entrypoints.openai.replica", "--rank", str(rank),
                     "--parent", str(os.getpid()), "--served-model-name", *names, "--threads", str(threads),
                     "--llm-kwargs", json.dumps(llm_kwargs or {})] + (["--dev-mode"] if dev_mode else []),
                    stdout=subprocess.PIPE, stderr=None, text=True, env=env))
            deadline = time.monotonic() + startup_timeout
            for rank, process in enumerate(self.processes):
                self.urls[rank] = self._announced(rank, process, deadline)
            for url in self.urls:
                self._wait_healthy(url, deadline)
        except BaseException:
            self.stop()
            raise

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

