"""The grader's fresh process for one exercise: run its check on the answer taken from a notebook.

    python -m minivllm.tools.grade_check

stdin: a hex key line, then one JSON line {"name", "definitions": [statement, ...], "answer"}; the descriptor
that is stdout at start is the verdict channel.

The check runner is imported, and the key read, before any of the notebook's code runs, so patching
`minivllm.exercises.run_checks` from the answer changes nothing here. The verdict goes out on the descriptor
that was stdout at start, as `<HMAC-SHA256 of the message under the key> <message>`; the answer's own prints
go to stderr. The grader accepts only a line whose MAC verifies, and the notebook never had the key, so
nothing a notebook prints or writes can pass for a verdict. (Code written to dig the key out of this
process's memory could still forge one: that is why grading belongs in a container, and why answers that
reach into the check machinery are flagged.)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys


def sign(key: bytes, message: str) -> str:
    return hmac.new(key, message.encode("utf-8"), hashlib.sha256).hexdigest()


def verified(key: bytes, output: str) -> dict | None:
    """The verdict in `output` whose MAC verifies under `key`, or None."""
    for line in output.splitlines():
        mac, _, message = line.partition(" ")
        if message and hmac.compare_digest(mac, sign(key, message)):
            return json.loads(message)
    return None


def _judge(request: dict) -> tuple[bool, list[str]]:
    from minivllm.exercises import _load_chapters, run_checks

    _load_chapters()
    if request["name"] == "08.tile_update":  # the check runs the kernel in Triton's interpreter, which must be
        from minivllm.kernels.interpreter import use_interpreter_without_gpu  # on before the answer imports triton

        use_interpreter_without_gpu()
    namespace = {"__name__": "__main__"}
    for statement in request["definitions"]:
        try:  # one by one: a definition that needs a value the notebook computed (dropped) costs only itself
            exec(compile(statement, "<the notebook's definitions>", "exec"), namespace)
        except BaseException:  # noqa: BLE001  the notebook's code, whatever it raises (SystemExit included)
            continue
    try:
        candidate = eval(compile(request["answer"], "<the answer>", "eval"), namespace)
    except BaseException as error:  # noqa: BLE001
        return False, [f"✗ {request['name']}: the answer is not defined from the notebook's definitions: "
                       f"{type(error).__name__}: {error}"]
    module = getattr(candidate, "__module__", None) or ""
    if module.startswith("minivllm"):
        return False, [f"✗ {request['name']}: the answer is {module}.{getattr(candidate, '__qualname__', '?')}, "
                       "the package's own code, not yours"]
    try:
        return run_checks(request["name"], candidate)
    except BaseException as error:  # noqa: BLE001  SystemExit, KeyboardInterrupt from the answer
        return False, [f"✗ {request['name']}: the check stopped: {type(error).__name__}: {error}"]


def main() -> None:
    key = bytes.fromhex(sys.stdin.readline().strip())
    request = json.loads(sys.stdin.readline())
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the answer's prints go to stderr, never onto the channel's descriptor number
    sys.stdout = sys.stderr
    passed, report = _judge(request)
    message = json.dumps({"name": request["name"], "passed": bool(passed), "report": list(report)},
                         ensure_ascii=False)
    channel.write(f"{sign(key, message)} {message}\n")
    channel.flush()
    os._exit(0)  # no atexit hook or thread the answer left behind runs after the verdict


if __name__ == "__main__":
    main()
