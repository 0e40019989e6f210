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


def latencies_divides_by_pieces(sent, arrivals, num_tokens):  # pieces counted instead of tokens
    ttft = arrivals[0] - sent
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else None
    return ttft, tpot, [b - a for a, b in zip(arrivals, arrivals[1:])]


def latencies_tpot_from_sent(sent, arrivals, num_tokens):
    ttft = arrivals[0] - sent
    tpot = (arrivals[-1] - sent) / num_tokens if num_tokens > 1 else None
    return ttft, tpot, [b - a for a, b in zip(arrivals, arrivals[1:])]


WRONG = {
    "10.parse_sse": [parse_keeps_done, parse_splits_on_data],
    "10.sendable_text": [sendable_imports_the_answer, sendable_holds_nothing, sendable_holds_whole_stop,
                         sendable_counts_bytes, sendable_one_partial_only],
    "10.request_latencies": [latencies_divides_by_pieces, latencies_tpot_from_sent],
}
