"""Chapter 10 exercises."""

import json
import random

from minivllm.exercises import exercise, expect


def _response(events: list[dict], done: bool = True) -> str:
    head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n"
    return head + "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ("data: [DONE]\n\n" if done else "")


@exercise("10.parse_sse")
def _parse_sse():
    def case(events, done, what):
        def test(parse_sse):
            got = list(parse_sse(_response(events, done)))
            expect(got == events, f"{what}: got {got[:3]}{'...' if len(got) > 3 else ''}, expected {events[:3]}")
        return test

    rng = random.Random(0)
    pieces = [{"choices": [{"index": 0, "text": rng.choice(["a", " b", "\n", "data: x", ""]),
                            "finish_reason": None}]} for _ in range(12)]
    return [
        ("one event", case([{"choices": [{"index": 0, "text": "Hi", "finish_reason": "length"}]}], True, "1 event")),
        ("many events, text that looks like SSE", case(pieces, True, "12 events")),
        ("no events", case([], True, "an empty stream")),
        ("a usage event with no choices", case([{"choices": [], "usage": {"completion_tokens": 3}}], True, "usage")),
        ("a stream cut before [DONE]", case(pieces[:4], False, "4 events, no [DONE]")),
    ]


@exercise("10.sendable_text")
def _sendable_text():
    from minivllm.entrypoints.openai_server import sendable_text

    def case(text, finished, stop):
        def test(candidate):
            got, want = candidate(text, finished, list(stop)), sendable_text(text, finished, list(stop))
            expect(got == want, f"({text!r}, finished={finished}, stop={stop}): got {got!r}, expected {want!r}")
        return test

    return [
        ("plain text goes out whole", case("To be, or not", False, [])),
        ("a trailing partial character waits", case("morrow \ufffd", False, [])),
        ("... unless the output is finished", case("morrow \ufffd", True, [])),
        ("the possible start of a stop string waits", case("my good lo", False, ["lord"])),
        ("the longest stop string decides", case("abcdefgh", False, ["xy", "long stop"])),
        ("text shorter than the hold-back", case("ab", False, ["a long stop"])),
        ("finished text goes out whole", case("my good lo", True, ["lord"])),
    ]


@exercise("10.request_latencies")
def _request_latencies():
    def case(sent, arrivals, tokens, want, what):
        def test(request_latencies):
            ttft, tpot, itls = request_latencies(sent, list(arrivals), tokens)
            expect(abs(ttft - want[0]) < 1e-9, f"{what}: TTFT {ttft}, expected {want[0]}")
            expect((tpot is None) == (want[1] is None) and (tpot is None or abs(tpot - want[1]) < 1e-9),
                   f"{what}: TPOT {tpot}, expected {want[1]}")
            expect(len(itls) == len(want[2]) and all(abs(a - b) < 1e-9 for a, b in zip(itls, want[2])),
                   f"{what}: ITLs {itls}, expected {want[2]}")
        return test

    return [
        ("one piece per token", case(0.0, [0.5, 0.6, 0.8], 3, (0.5, 0.15, [0.1, 0.2]), "3 tokens")),
        ("pieces of several tokens", case(10.0, [10.2, 11.0], 5, (0.2, 0.2, [0.8]), "5 tokens in 2 pieces")),
        ("a single token has no TPOT", case(1.0, [1.25], 1, (0.25, None, []), "1 token")),
    ]
