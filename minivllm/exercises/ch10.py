"""Chapter 10 exercises."""

import json

from minivllm.exercises import case_random, exercise, expect, forbidden_calls


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

    rng = case_random("10.parse_sse")
    pieces = [{"choices": [{"index": 0, "text": rng.choice(["a", " b", "\n", "data: x", ""]),
                            "finish_reason": None}]} for _ in range(12)]
    return [
        ("one event", case([{"choices": [{"index": 0, "text": "Hi", "finish_reason": "length"}]}], True, "1 event")),
        ("many events, text that looks like SSE", case(pieces, True, "12 events")),
        ("no events", case([], True, "an empty stream")),
        ("a usage event with no choices", case([{"choices": [], "usage": {"completion_tokens": 3}}], True, "usage")),
        ("a stream cut before [DONE]", case(pieces[:4], False, "4 events, no [DONE]")),
    ]


def _sendable_reference(text, finished, stop):
    """Written apart from the server's: a finished output goes out whole; otherwise trailing replacement
    characters (a character still missing bytes) wait, and so do the last len(longest stop) - 1 characters."""
    if finished:
        return text
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = max([len(s) - 1 for s in stop], default=0)
    return text[:max(end - hold, 0)]


@exercise("10.sendable_text")
def _sendable_text():
    from minivllm.entrypoints import openai_server

    def case(text, finished, stop):
        def test(candidate):
            with forbidden_calls([openai_server.sendable_text], "write the hold-back rule yourself"):
                got = candidate(text, finished, list(stop))
            want = _sendable_reference(text, finished, list(stop))
            expect(got == want, f"({text!r}, finished={finished}, stop={stop}): got {got!r}, expected {want!r}")
        return test

    rng = case_random("10.sendable_text")
    pieces = ["To be", ", or ", "not", " \ufffd", "\ufffd", "lord", " é", "\n"]
    drawn = [("".join(rng.choice(pieces) for _ in range(rng.randrange(0, 6))), rng.random() < 0.25,
              rng.sample(["lord", "\n\n", "END OF TEXT", "x"], rng.randrange(0, 3))) for _ in range(12)]
    return [
        ("plain text goes out whole", case("To be, or not", False, [])),
        ("a trailing partial character waits", case("morrow \ufffd", False, [])),
        ("two partial characters wait", case("morrow \ufffd\ufffd", False, [])),
        ("... unless the output is finished", case("morrow \ufffd", True, [])),
        ("a partial character inside the text goes out", case("a\ufffdb", False, [])),
        ("the possible start of a stop string waits", case("my good lo", False, ["lord"])),
        ("the longest stop string decides", case("abcdefgh", False, ["xy", "long stop"])),
        ("a one-character stop string holds nothing back", case("abc", False, ["c"])),
        ("text shorter than the hold-back", case("ab", False, ["a long stop"])),
        ("finished text goes out whole", case("my good lo", True, ["lord"])),
        ("characters, not bytes: an accented stop string", case("the café", False, ["éé"])),
        *[(f"random case {i}", case(*args)) for i, args in enumerate(drawn)],
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
