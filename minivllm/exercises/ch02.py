"""Chapter 2 exercises: the stop-string search, run inside chapter 2's generator against transformers' tokens."""

from minivllm.exercises import CheckFailed, case_random, exercise, expect

_PROMPT = "ROMEO:\n"
_TOKENS = 24
_INCREMENTAL = ("the search starts where a new stop string can begin: the earlier text was searched already, "
                "so that a token costs the same at the 10th token as at the 10,000th")


def _reading_from(name: str):
    """str's own `name(sub, start, end)`, after noting where its search starts."""
    def method(self, sub, start=None, end=None):
        self._read_from(start)
        return getattr(str, name)(self, sub, start, end)
    return method


class _SearchedText(str):
    """The settled text, remembering the lowest character any search read (find, index, in, a slice...)."""

    def __new__(cls, text: str):
        probe = super().__new__(cls, text)
        probe.lowest = len(text)
        return probe

    def _read_from(self, start) -> None:
        start = 0 if start is None else start + len(self) if start < 0 else start
        self.lowest = min(self.lowest, max(0, start))

    find, index, rfind, count, startswith = map(_reading_from, ("find", "index", "rfind", "count", "startswith"))

    def __contains__(self, sub):
        self._read_from(0)
        return str.__contains__(self, sub)

    def __iter__(self):
        self._read_from(0)
        return str.__iter__(self)

    def __getitem__(self, key):
        self._read_from(key.start if isinstance(key, slice) else key)
        return str.__getitem__(self, key)

    def split(self, *args, **kwargs):
        self._read_from(0)
        return str.split(self, *args, **kwargs)


def _reader_checker(find_stop):
    """Chapter 2's StopChecker with the reader's search in place of its own."""
    from minivllm.core.stop_checker import StopChecker

    class ReaderStopChecker(StopChecker):
        def _find_stop_string(self) -> bool:
            stops, settled = list(self.params.stop_strings), self.detokenizer.text
            text = _SearchedText(settled)
            cut = find_stop(text, self.searched, stops, self.params.include_stop_str_in_output)
            may_begin = max(0, self.searched - max(len(s) for s in stops) + 1)
            if text.lowest < may_begin - 1:  # one character early is allowed: it costs one comparison
                raise CheckFailed(f"your search read the text from character {text.lowest}, though "
                                  f"{self.searched} characters were searched before and no stop string could "
                                  f"begin before {may_begin}: {_INCREMENTAL}")
            expect(cut is None or (isinstance(cut, int) and 0 <= cut <= len(settled)),
                   f"find_stop returned {cut!r}: expected None or a position in the text (0..{len(settled)})")
            self.searched = len(settled)
            if cut is None:
                return False
            self.cut = cut
            return True

    return ReaderStopChecker


def _stopped(texts, stops, include):
    """Written apart from StopChecker: after which token the text first holds a stop string, and the text then
    (cut before the earliest stop string, or after it with include; of two that begin at the same place, the
    shorter was complete first). texts[k] is the text of k tokens."""
    for k in range(1, len(texts)):
        hits = [(texts[k].find(s), len(s)) for s in stops if s in texts[k]]
        if hits:
            position, length = min(hits)
            return k, texts[k][:position + length if include else position]
    return None, texts[-1]


@exercise("02.find_stop")
def _find_stop():
    from minivllm import SamplingParams, load_model
    from minivllm.book import recompute
    from minivllm.exercises.harness import swapped, transformers_greedy

    model, tokenizer = load_model()
    prompt_ids = tokenizer(_PROMPT).input_ids
    tokens = transformers_greedy([_PROMPT], _TOKENS)[0]
    texts = [tokenizer.decode(tokens[:k], skip_special_tokens=True) for k in range(len(tokens) + 1)]
    full = texts[-1]

    def case(stops, include=False):
        def test(find_stop):
            params = SamplingParams(temperature=0, max_tokens=_TOKENS, ignore_eos=True, stop=list(stops),
                                    include_stop_str_in_output=include)
            with swapped(recompute, "StopChecker", _reader_checker(find_stop)):
                done = recompute.generate_recompute(model, prompt_ids, params, tokenizer)
            k, text = _stopped(texts, stops, include)
            want_tokens, want_reason = (tokens[:k], "stop") if k else (tokens, "length")
            where = f"stop={list(stops)}, include_stop_str_in_output={include}"
            expect(done.token_ids == want_tokens, f"{where}: generation ended after {len(done.token_ids)} tokens, "
                                                  f"transformers' text first holds a stop string after "
                                                  f"{len(want_tokens) if k else 'none of its'} {_TOKENS} tokens")
            expect(done.finish_reason == want_reason, f"{where}: finish_reason {done.finish_reason!r}, "
                                                      f"expected {want_reason!r}")
            expect(done.text == text, f"{where}: text {done.text!r}, expected {text!r}")
        return test

    def straddling(pieces):
        """A stop string that ends in token k and begins `pieces - 1` tokens before it, new at token k."""
        for k in range(pieces, len(texts)):
            begin = len(texts[k - pieces + 1]) - 1
            stop = full[begin:len(texts[k - 1]) + 1]
            if len(texts[k - 1]) < len(texts[k]) and begin >= 0 and stop not in texts[k - 1] and \
                    full.find(stop) == begin and len(texts[k - pieces + 1]) > len(texts[k - pieces]):
                return stop
        raise AssertionError(f"no stop string over {pieces} tokens in {full!r}")

    def completed_together():
        """A stop string and its own beginning, both first complete in the same token: the shorter wins."""
        for k in range(1, len(texts)):
            piece = texts[k][len(texts[k - 1]):].strip()
            if len(piece) >= 3 and full.find(piece) >= len(texts[k - 1]) and full.find(piece[:-1]) == full.find(piece):
                return [piece, piece[:-1]]
        raise AssertionError(f"no token of {full!r} holds a new word of 3 characters")

    words = full.split()
    late, early = words[-2], words[1]  # listed late first: the earliest in the text must win
    rng = case_random("02.find_stop")
    drawn = []
    for _ in range(3):
        start = rng.randrange(len(full) - 6)
        drawn.append(([full[start:start + rng.randrange(1, 6)] for _ in range(1)]
                      + rng.sample(["lord", "\n\n", ":", "thee", "zzz"], rng.randrange(0, 3)), rng.random() < 0.5))
    return [
        ("a stop string that never appears: the budget ends it", case(["never in this text"])),
        ("a stop string in the first token: nothing is left", case([full[0]])),
        ("a stop string that straddles two tokens", case([straddling(2)])),
        ("one that begins two tokens back (look back by the longest stop string, less one)",
         case([straddling(3), "x" * 9])),
        ("the earliest stop string in the text wins, not the first listed", case([late, early])),
        ("include_stop_str_in_output keeps the stop string", case([early, late], include=True)),
        ("two that begin at the same place: the shorter was complete first",
         case(completed_together(), include=True)),
        *[(f"random stop strings {i}", case(stops, include)) for i, (stops, include) in enumerate(drawn)],
    ]


class _CountingTokenizer:
    """A tokenizer's decode, recording how many ids each call decodes; `drop_leading_space` makes it decode as
    SentencePiece tokenizers (Llama's) do, which drop the space that starts a string."""

    def __init__(self, tokenizer, drop_leading_space=False):
        self.tokenizer, self.drop_leading_space, self.lengths = tokenizer, drop_leading_space, []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text[1:] if self.drop_leading_space and text.startswith(" ") else text


def _reader_detokenizer(settle):
    """Chapter 2's IncrementalDetokenizer with the reader's step in place of its own."""
    from minivllm.core.stop_checker import IncrementalDetokenizer

    class ReaderDetokenizer(IncrementalDetokenizer):
        def update(self, token_ids: list[int]) -> None:
            if len(token_ids) == self.read_offset:
                return
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
            answer = settle(decode, list(token_ids), self.prefix_offset, self.read_offset)
            expect(isinstance(answer, tuple) and len(answer) == 3 and isinstance(answer[0], str),
                   f"settle returned {answer!r}: expected (new_text, prefix_offset, read_offset)")
            new_text, prefix_offset, read_offset = answer
            expect(0 <= prefix_offset <= read_offset <= len(token_ids),
                   f"offsets ({prefix_offset}, {read_offset}) for {len(token_ids)} tokens: need "
                   f"0 <= prefix_offset <= read_offset <= {len(token_ids)}")
            self.text += new_text
            self.prefix_offset, self.read_offset = prefix_offset, read_offset

    return ReaderDetokenizer


def _settled(decode, ids):
    """Written apart from IncrementalDetokenizer: the settled text after each token, the whole text decoded again
    each time (text settles at a token whose decoding with all before it ends on a whole character)."""
    settled, texts = "", []
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if not text.endswith("\ufffd") and len(text) > len(settled):
            settled = text
        texts.append(settled)
    return texts


@exercise("02.detokenize")
def _detokenize():
    from minivllm import SamplingParams, load_model
    from minivllm.book import recompute
    from minivllm.core import stop_checker
    from minivllm.exercises.harness import swapped, transformers_greedy

    model, tokenizer = load_model()

    def greedy(settle):
        prompt = "JULIET:\n"
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        with swapped(stop_checker, "IncrementalDetokenizer", _reader_detokenizer(settle)):
            done = recompute.generate_recompute(model, tokenizer(prompt).input_ids, params, tokenizer)
        want = tokenizer.decode(transformers_greedy([prompt], 12)[0], skip_special_tokens=True)
        expect(done.text == want, f"the generation's text {done.text!r}, transformers' tokens decode to {want!r}")

    def fed(text, drop_leading_space=False, repeat=1):
        def test(settle):
            ids = tokenizer(text).input_ids * repeat
            counting = _CountingTokenizer(tokenizer, drop_leading_space)
            want = _settled(_CountingTokenizer(tokenizer, drop_leading_space).decode, ids)
            detokenizer = _reader_detokenizer(settle)(counting)
            for k in range(1, len(ids) + 1):
                detokenizer.update(ids[:k])
                expect(detokenizer.text == want[k - 1], f"{text[:30]!r}: after token {k} of {len(ids)}, settled "
                                                        f"text ends {detokenizer.text[-20:]!r}, expected "
                                                        f"{want[k - 1][-20:]!r}")
            expect(max(counting.lengths) <= 16, f"{text[:30]!r}: a decode of {max(counting.lengths)} tokens at "
                                                f"once: decode only the tail (the tokens from prefix_offset on)")
            whole = _CountingTokenizer(tokenizer, drop_leading_space).decode(ids)
            expect(detokenizer.full_text(ids) == whole, f"{text[:30]!r}: full_text {detokenizer.full_text(ids)!r}, "
                                                        f"decoding all the tokens gives {whole!r}")
        return test

    rng = case_random("02.detokenize")
    pieces = ["To be", " or", " not", " é", "ï", " 🙂", "日本", " façade", "\n", " lord", "!"]
    drawn = "".join(rng.choice(pieces) for _ in range(rng.randrange(8, 20)))
    return [
        ("greedy generation: the text is transformers' tokens decoded", greedy),
        ("plain ASCII text", fed("ROMEO:\nBut soft, what light through yonder window breaks?")),
        ("characters split over several tokens wait until they are whole", fed("café 🙂 naïve 日本語")),
        ("a tokenizer that drops a leading space (SentencePiece's): decode the new tokens with context",
         fed(" my good lord, the king")),
        ("a long output: every decode is of the tail only", fed(" Now is the winter of our discontent", repeat=12)),
        (f"random: {drawn[:24]!r}...", fed(drawn, drop_leading_space=rng.random() < 0.5)),
    ]
