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


def _latencies(sent, pieces):
    """Written apart from the load generator's: pieces are (arrival, tokens it brought)."""
    arrivals, num_tokens = [t for t, _ in pieces], sum(n for _, n in pieces)
    tpot = (arrivals[-1] - arrivals[0]) / (num_tokens - 1) if num_tokens > 1 else None
    return arrivals[0] - sent, tpot, [b - a for a, b in zip(arrivals, arrivals[1:])]


async def _timed_requests(time_request, requests):
    """Each request (prompt ids, SamplingParams, launch delay, slow) through a real AsyncLLM, timed by the
    reader's function with a clock that stands still between the stream's events: the clock reads the moment
    the last event was seen, so the exact answer is known. A slow reader gets every second output only (the
    collector then hands over several tokens in one piece). Returns per request: the trace, the reader's
    answer and the engine's own metrics."""
    import asyncio
    import time

    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.entrypoints.llm import LLM

    front = AsyncLLM(LLM(num_kv_blocks=64, device="cpu"))

    async def one(prompt_ids, params, delay, slow):
        await asyncio.sleep(delay)
        now = [time.perf_counter()]
        trace = {"sent": now[0], "pieces": [], "metrics": None}

        async def stream():
            seen, count = 0, 0
            async for output in front.generate(prompt_ids, params):
                count += 1
                if slow and count % 2 and not output.finished:
                    continue
                now[0] = time.perf_counter()
                tokens = len(output.outputs[0].token_ids)
                if tokens > seen:
                    trace["pieces"].append((now[0], tokens - seen))
                seen, trace["metrics"] = tokens, output.metrics
                yield output

        answer = await time_request(stream(), lambda: now[0])
        return trace, answer

    try:
        return await asyncio.gather(*(one(*request) for request in requests))
    finally:
        await front.shutdown()


@exercise("10.request_latencies")
def _request_latencies():
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from minivllm import SamplingParams

    def case(requests):
        """requests: (prompt length, tokens, launch delay in seconds, slow reader)."""
        def test(time_request):
            jobs = [(list(range(5, 5 + n)), SamplingParams(temperature=0, max_tokens=t, ignore_eos=True), d, slow)
                    for n, t, d, slow in requests]
            with ThreadPoolExecutor(1) as pool:  # a loop of its own: a notebook's cell runs inside one already
                results = pool.submit(asyncio.run, _timed_requests(time_request, jobs)).result()
            for i, (trace, answer) in enumerate(results):
                what = f"request {i} ({requests[i][1]} tokens in {len(trace['pieces'])} pieces)"
                expect(isinstance(answer, tuple) and len(answer) == 3, f"{what}: return (ttft, tpot, itls)")
                ttft, tpot, itls = answer
                want = _latencies(trace["sent"], trace["pieces"])
                expect(isinstance(ttft, float) and abs(ttft - want[0]) < 1e-9,
                       f"{what}: TTFT {ttft}, expected {want[0]:.6f}")
                expect(ttft >= trace["metrics"].ttft, f"{what}: TTFT {ttft:.4f} s, shorter than the engine's own "
                                                      f"(first token - arrival: {trace['metrics'].ttft:.4f} s)")
                expect((tpot is None) == (want[1] is None) and (tpot is None or abs(tpot - want[1]) < 1e-9),
                       f"{what}: TPOT {tpot}, expected {want[1]}")
                expect(len(list(itls)) == len(want[2]) and all(abs(a - b) < 1e-9 for a, b in zip(itls, want[2])),
                       f"{what}: {len(list(itls))} ITLs {[round(x, 4) for x in itls][:4]}, expected {len(want[2])} "
                       f"{[round(x, 4) for x in want[2]][:4]}")
        return test

    rng = case_random("10.request_latencies")
    drawn = [(rng.randrange(1, 40), rng.randrange(1, 12), rng.random() * 0.2, rng.random() < 0.5) for _ in range(4)]
    return [
        ("one request, one token a piece", case([(8, 6, 0.0, False)])),
        ("a single token has no TPOT and no ITL", case([(8, 1, 0.0, False)])),
        ("a slow reader: pieces of several tokens (TPOT counts tokens, ITLs pieces)", case([(8, 9, 0.0, True)])),
        ("four requests at once, of 1, 3, 8 and 16 tokens", case([(5, 1, 0, False), (20, 3, 0, True),
                                                                 (3, 8, 0, False), (30, 16, 0, True)])),
        (f"random: {len(drawn)} requests launched at random moments", case(drawn)),
    ]
