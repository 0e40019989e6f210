"""Chapter 11's worker-process plumbing, not taught: making fork safe for OpenMP, and keeping each worker's
stderr in a file, so that a worker that dies before it can report is still explained by its last lines."""

import contextlib
import ctypes
import os
import signal
import sys
import tempfile

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t, OpenMP 5.0


def release_openmp_threads() -> None:
    """Join libgomp's idle worker threads, so that a forked child can run OpenMP (vLLM 0.33.0 does the same,
    `_release_libgomp_threads` in vllm/utils/system_utils.py). libgomp has no fork handler: once this process
    has run a parallel region (any multi-threaded torch CPU op), a forked child that runs one itself waits
    forever for threads that were not forked. Pausing joins them; this process starts new ones when next needed."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as maps:
            libraries = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
        for path in sorted(libraries):
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(path).omp_pause_resource_all(_OMP_PAUSE_HARD)


def new_log(rank: int) -> str:
    """An empty file for rank's stderr, removed by remove_logs when its worker has stopped."""
    fd, path = tempfile.mkstemp(prefix=f"minivllm-tp-rank{rank}-", suffix=".log")
    os.close(fd)
    return path


@contextlib.contextmanager
def stderr_to(path: str):
    """Processes started inside this block write their stderr (file descriptor 2) to `path`, from their first
    instruction on: also what a spawned child prints before its target runs. This process keeps its own."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def log_tail(path: str, lines: int = 25) -> str:
    """The last lines of a worker's stderr ('' if it wrote none or the file is gone)."""
    try:
        with open(path, errors="replace") as log:
            return "".join(log.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


def remove_logs(paths) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.remove(path)


def how_it_ended(exitcode: int | None) -> str:
    """'exit code 1', or 'killed by SIGKILL' for a process a signal ended (a negative exit code)."""
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"
