"""Wrong answers to chapter 10's exercises."""

import json

from minivllm.entrypoints.openai_server import sendable_text


def parse_keeps_done(raw):
    body = raw.split("\r\n\r\n", 1)[1]
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else None for line in body.split("\n")
            if line.startswith("data: ")]


def parse_splits_on_data(raw):  # breaks on text that contains "data: "
    body = raw.split("\r\n\r\n", 1)[1]
    return [json.loads(part.strip()) for part in body.split("data: ")[1:] if part.strip() != "[DONE]"]


def sendable_imports_the_answer(text, finished, stop):
    return sendable_text(text, finished, stop)


def sendable_holds_nothing(text, finished, stop):
    return text if finished else text.rstrip("\ufffd")


def sendable_holds_whole_stop(text, finished, stop):  # len(stop) held back, not len(stop) - 1
    if finished:
        return text
    text = text.rstrip("\ufffd")
    return text[:max(0, len(text) - max((len(s) for s in stop), default=0))]


def sendable_counts_bytes(text, finished, stop):  # bytes counted instead of characters
    if finished:
        return text
    text = text.rstrip("\ufffd")
    hold = max((len(s.encode()) - 1 for s in stop), default=0)
    return text.encode()[:max(0, len(text.encode()) - hold)].decode(errors="ignore")


def sendable_one_partial_only(text, finished, stop):
    if finished:
        return text
    text = text[:-1] if text.endswith("\ufffd") else text
    hold = max((len(s) - 1 for s in stop), default=0)
    return text[:max(0, len(text) - hold)]


async def _time(stream, clock, sent_after_first=False, tokens_are_pieces=False, tpot_over="n - 1", first_gap=False):
    sent, arrivals, num_tokens, pieces = None if sent_after_first else clock(), [], 0, 0
    async for output in stream:
        tokens = len(output.outputs[0].token_ids)
        if tokens > num_tokens:
            arrivals.append(clock())
            num_tokens, pieces = tokens, pieces + 1
            sent = arrivals[0] if sent is None else sent
    n = pieces if tokens_are_pieces else num_tokens
    tpot = (arrivals[-1] - arrivals[0]) / (n - 1 if tpot_over == "n - 1" else n) if n > 1 else None
    gaps = [b - a for a, b in zip([sent] + arrivals if first_gap else arrivals, arrivals)]
    return arrivals[0] - sent, tpot, gaps


async def latencies_pieces_counted_as_tokens(stream, clock):
    return await _time(stream, clock, tokens_are_pieces=True)


async def latencies_sent_at_the_first_piece(stream, clock):
    return await _time(stream, clock, sent_after_first=True)


async def latencies_tpot_over_all_tokens(stream, clock):
    return await _time(stream, clock, tpot_over="n")


async def latencies_first_gap_is_an_itl(stream, clock):  # TTFT counted among the inter-token latencies
    return await _time(stream, clock, first_gap=True)


WRONG = {
    "10.parse_sse": [parse_keeps_done, parse_splits_on_data],
    "10.sendable_text": [sendable_imports_the_answer, sendable_holds_nothing, sendable_holds_whole_stop,
                         sendable_counts_bytes, sendable_one_partial_only],
    "10.request_latencies": [latencies_pieces_counted_as_tokens, latencies_sent_at_the_first_piece,
                             latencies_tpot_over_all_tokens, latencies_first_gap_is_an_itl],
}

RUN_THE_MODEL = {"10.request_latencies"}
