"""Run a command the grader does not trust under CPU, memory and wall-time limits, and leave nothing of it behind.

    python minivllm/tools/containment.py WALL_S CPU_S MEMORY_BYTES STDOUT_FILE -- COMMAND...

A supervisor process (this module's main) makes itself a child subreaper (Linux's PR_SET_CHILD_SUBREAPER), so
every process the command starts stays its descendant even after a double fork and `setsid()`: a daemon cannot
reparent itself to init. The command runs in a session of its own with RLIMIT_DATA (memory) and RLIMIT_CPU (CPU
seconds, per process) set; at the wall limit, or as soon as the command itself exits, the supervisor SIGKILLs
every descendant it can find in /proc, again and again until none is left (a process that forks while it is
being killed is caught by the next sweep). SIGKILL cannot be caught or ignored, so a kernel that disabled its
own exit goes too. It prints one JSON line on its stdout, which the command never holds:

    {"returncode": 0, "timed_out": false, "leftovers_killed": 0}

`returncode` is negative for a signal (-9: killed, -24: SIGXCPU, the CPU limit). Off Linux (no /proc, no
subreaper) only the command's process group is killed.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script (no torch import for a supervisor): the tools folder is no import root

import ctypes  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36


def contained(command: list[str], wall_s: float, cpu_s: float, memory_bytes: int, stdout_file: Path,
              stdin_data: bytes = b"", env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run `command` under a supervisor (see the module doc) and return the supervisor's JSON report. The
    command's stdout and stderr go to `stdout_file`; `stdin_data` is its stdin."""
    supervisor = [sys.executable, os.path.abspath(__file__), str(wall_s), str(cpu_s), str(memory_bytes),
                  str(stdout_file), "--", *command]
    # the supervisor itself has no limit but the wall one, plus a margin for its final sweeps
    run = subprocess.run(supervisor, input=stdin_data, capture_output=True, env=env, cwd=cwd,
                         timeout=wall_s + 60)
    lines = run.stdout.decode("utf-8", "replace").strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"returncode": run.returncode, "timed_out": False, "leftovers_killed": 0,
                "supervisor_error": run.stderr.decode("utf-8", "replace")[-500:]}


def _limits(cpu_s: float, memory_bytes: int):
    def apply():  # runs in the child between fork and exec: the limits hold for everything it starts
        cpu = max(1, int(cpu_s))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL a second later
        # RLIMIT_DATA, not RLIMIT_AS: it counts the writable private memory a process maps (its heap, torch's
        # tensors), not address space merely reserved (thread arenas, CUDA's reservations), which is no memory
        resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    return apply


def _descendants(root: int) -> list[int]:
    """Every process whose parent chain leads to `root`, read from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    found, frontier = [], [root]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found += kids
        frontier += kids
    return found


def _reap() -> None:
    """Collect every exited child (orphans handed to us as the subreaper included), so none stays a zombie."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_everything(child: subprocess.Popen) -> int:
    """SIGKILL the command's process group and every descendant until none is left; how many leftovers."""
    killed = 0
    with _ignoring(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    for _ in range(200):  # a fork bomb refills the tree between sweeps; 200 sweeps of 20 ms is plenty
        alive = [pid for pid in _descendants(os.getpid()) if not _is_zombie(pid)]
        if not alive:
            break
        for pid in alive:
            with _ignoring(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += pid != child.pid
        _reap()
        time.sleep(0.02)
    _reap()
    return killed


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class _ignoring:
    def __init__(self, *errors):
        self.errors = errors

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is not None and issubclass(kind, self.errors)


def main(argv: list[str]) -> int:
    wall_s, cpu_s, memory_bytes, stdout_file = float(argv[0]), float(argv[1]), int(argv[2]), Path(argv[3])
    command = argv[argv.index("--") + 1:]
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # our own stdout is the report channel: the command gets a file instead, and never this descriptor
    report = os.fdopen(os.dup(1), "w")
    with open(stdout_file, "wb") as output:
        child = subprocess.Popen(command, stdin=sys.stdin, stdout=output, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=_limits(cpu_s, memory_bytes))
    timed_out = False
    try:
        child.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    leftovers = _kill_everything(child)
    child.wait()
    report.write(json.dumps({"returncode": child.returncode, "timed_out": timed_out,
                             "leftovers_killed": leftovers}) + "\n")
    report.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
