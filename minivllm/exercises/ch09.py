"""Chapter 9 exercises."""

import math
import random

import torch

from minivllm.exercises import case_random, case_seed, exercise, expect, forbidden_calls, note


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """How likely counts at least this far from `probs` are by chance: the upper tail of Pearson's statistic
    (Wilson-Hilferty approximation), over the categories with p > 0. A count where p = 0 gives 0."""
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return 0.0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    statistic = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _ngram_reference(tokens, k, prompt_lookup_max, prompt_lookup_min):
    """Prompt lookup written apart from the package's: the longest n first; for it, the last earlier place
    (not the tail itself) its final n tokens appeared; what followed there, at most k tokens."""
    for n in range(prompt_lookup_max, prompt_lookup_min - 1, -1):
        if n >= len(tokens):
            continue
        tail = tuple(tokens[len(tokens) - n:])
        places = [start for start in range(len(tokens) - n) if tuple(tokens[start:start + n]) == tail]
        if places:
            return list(tokens[places[-1] + n:places[-1] + n + k])
    return []


@exercise("09.ngram_lookup")
def _ngram_lookup():
    from minivllm.spec_decode.ngram_proposer import NgramProposer

    def case(tokens, k, high, low, what):
        def test(ngram_lookup):
            package = [f for f in vars(NgramProposer).values() if callable(f) and hasattr(f, "__code__")]
            with forbidden_calls(package, "look the n-grams up yourself"):
                got = list(ngram_lookup(list(tokens), k, high, low))
            want = _ngram_reference(tokens, k, high, low)
            expect(got == want, f"{what}: got {got}, expected {want}")
        return test

    def many(cases):
        return lambda fn: [case(*args, f"random {args[0]}, k={args[1]}, n {args[3]}..{args[2]}")(fn) for args in cases]

    rng = case_random("09.ngram_lookup")
    randoms = []
    for _ in range(40):
        low = rng.randrange(1, 4)
        randoms.append(([rng.randrange(4) for _ in range(rng.randrange(2, 40))], rng.randrange(1, 6),
                        low + rng.randrange(0, 3), low))
    return [
        ("the 2-gram [2, 3] was followed by 4, 9", case([1, 2, 3, 4, 9, 2, 3], 2, 3, 1, "[1, 2, 3, 4, 9, 2, 3]")),
        ("the latest earlier match wins", case([1, 2, 3, 1, 2, 7, 1, 2], 3, 3, 1, "[1, 2, 3, 1, 2, 7, 1, 2]")),
        ("longer n-grams are tried first", case([5, 1, 2, 8, 3, 1, 2, 9, 5, 1, 2], 1, 3, 1, "3-gram [5, 1, 2]")),
        ("nothing repeats: no guess", case([5, 6, 7, 8], 2, 3, 1, "[5, 6, 7, 8]")),
        ("the continuation is cut at the end of the text", case([4, 4], 3, 3, 1, "[4, 4]")),
        ("an overlapping match", case([7, 7, 7], 2, 2, 2, "[7, 7, 7]")),
        ("no n-grams shorter than the minimum", case([1, 2, 1, 2], 4, 3, 3, "min 3")),
        ("at most k guesses", case([1, 2, 3, 4, 5, 6, 1, 2], 2, 2, 2, "k = 2")),
        ("40 random sequences over 4 tokens", many(randoms)),
    ]


@exercise("09.verify_sampled")
def _verify_sampled():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.4, 0.3, 0.1, 0.1, 0.1]])

    def distribution(one_hot: bool):
        def test(verify_sampled):
            generator = torch.Generator().manual_seed(case_seed(0))
            first, second = torch.zeros(5), torch.zeros(5)
            for _ in range(20_000):
                if one_hot:
                    tokens = [1, 3]
                    out = list(verify_sampled(p, tokens, None, generator))
                else:
                    tokens = [int(torch.multinomial(row, 1, generator=generator)) for row in q]
                    out = list(verify_sampled(p, tokens, q, generator))
                expect(1 <= len(out) <= 3 and out[:-1] == tokens[:len(out) - 1],
                       f"drafts {tokens} gave {out}: expected accepted drafts, then one token of the target's")
                first[out[0]] += 1
                if len(out) >= 2:
                    second[out[1]] += 1
            expect(chi_square_p_value(first, p[0]) > 1e-4,
                   f"first token frequencies {[round(x, 3) for x in (first / first.sum()).tolist()]}, "
                   f"target {p[0].tolist()}")
            expect(chi_square_p_value(second, p[1]) > 1e-4,
                   f"second token (after an accepted first) {[round(x, 3) for x in (second / second.sum()).tolist()]}, "
                   f"target {p[1].tolist()}")
        return test

    def perfect_draft(verify_sampled):
        generator = torch.Generator().manual_seed(case_seed(1))
        for _ in range(200):
            tokens = [int(torch.multinomial(row, 1, generator=generator)) for row in p[:2]]
            out = list(verify_sampled(p, tokens, p[:2], generator))
            expect(out[:2] == tokens, f"q = p must accept every draft; drafts {tokens} gave {out}")

    return [
        ("sampled drafts: the outputs follow the target", distribution(one_hot=False)),
        ("fixed guesses (draft_probs=None): the outputs follow the target", distribution(one_hot=True)),
        ("a draft equal to the target is always accepted", perfect_draft),
    ]


_SPEC_PROMPTS = [(0, 120), (400, 520), (1300, 1450)]  # slices of the corpus
_SPEC_TOKENS = 24


def _spec_prompts():
    from minivllm.book.texts import CORPUS

    return [CORPUS[a:b] for a, b in _SPEC_PROMPTS]


@exercise("09.expected_tokens")
def _expected_tokens():
    """The reader's measured_tokens_per_round(num_drafts, num_accepted_tokens_per_pos) reads vLLM's speculative
    counters after every step of a real SpecDecodeEngine run and says how many tokens a verification round has made on
    average; the check counts what each round of the run returned, and compares after every step."""
    from minivllm.entrypoints.llm import LLM
    from minivllm.sampling_params import SamplingParams
    from minivllm.spec_decode.engine import SpecDecodeModelRunner

    class CountingRunner(SpecDecodeModelRunner):
        """The speculative runner, noting how many tokens every round with drafts returned."""

        def sample(self, scheduled, hidden, query_start_loc):
            out = super().sample(scheduled, hidden, query_start_loc)
            for request, n in scheduled:
                if request.num_computed_tokens + n > request.num_tokens:  # it verified drafts this step
                    self.round_sizes.append(len(out.new_token_ids[request]))
            return out

    def by_hand(num_drafts, per_pos, want, what):
        def test(expected_tokens):
            got = expected_tokens(num_drafts, list(per_pos))
            expect(isinstance(got, (int, float)) and abs(got - want) < 1e-9,
                   f"{what}: measured_tokens_per_round({num_drafts}, {per_pos}) = {got!r}, expected {want}")
        return test

    def in_the_engine(spec, temperature, seed):
        def test(expected_tokens):
            llm = LLM(num_kv_blocks=24, max_num_seqs=3, max_num_batched_tokens=64, device="cpu",
                      speculative_config=spec)
            engine = llm.engine
            engine.model_runner.__class__ = CountingRunner
            engine.model_runner.round_sizes = []
            for i, prompt in enumerate(_spec_prompts()):
                engine.add_request(str(i), engine.tokenizer.encode(prompt), SamplingParams(
                    temperature=temperature, seed=seed + i, max_tokens=_SPEC_TOKENS, ignore_eos=True))
            step, formula = 0, None
            while engine.has_unfinished_requests():
                engine.step()
                step += 1
                stats, sizes = engine.stats(), engine.model_runner.round_sizes
                drafts, per_pos = stats["spec_decode_num_drafts"], stats["spec_decode_num_accepted_tokens_per_pos"]
                want = sum(sizes) / len(sizes) if sizes else 1.0
                got = expected_tokens(drafts, list(per_pos))
                expect(isinstance(got, (int, float)) and abs(got - want) < 1e-9,
                       f"{spec['method']}, k={len(per_pos)}, after step {step}: "
                       f"measured_tokens_per_round({drafts}, {per_pos}) = "
                       f"{got!r}, but its {len(sizes)} rounds made {sum(sizes)} tokens: {want:.6f} a round")
                if drafts:  # vLLM's acceptance rate: accepted guesses over guesses made
                    k, alpha = len(per_pos), sum(per_pos) / stats["spec_decode_num_draft_tokens"]
                    formula = k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
            expect(len(engine.model_runner.round_sizes) > 3, f"{spec['method']}: only "
                   f"{len(engine.model_runner.round_sizes)} rounds with drafts, so the case proved little")
            note(f"{spec['method']}, k={len(per_pos)}: {want:.2f} tokens a round; the chapter's formula with the run's "
                 f"alpha = {alpha:.2f} predicts {formula:.2f} (guesses are not independent, and the last rounds of "
                 f"a request guess fewer than k)")
        return test

    rng = case_random("09.expected_tokens")
    return [
        ("no drafts yet: one token a step, as plain decoding", by_hand(0, [0, 0, 0], 1.0, "no drafts")),
        ("by hand: 4 rounds, 3 first guesses accepted, 1 second one", by_hand(4, [3, 1, 0], 2.0, "4 rounds")),
        ("draft model, k=3, greedy, in the engine", in_the_engine({"method": "draft_model",
                                                                  "num_speculative_tokens": 3}, 0, 0)),
        ("n-gram, k=4, greedy, in the engine", in_the_engine({"method": "ngram", "num_speculative_tokens": 4,
                                                             "prompt_lookup_max": 4, "prompt_lookup_min": 2}, 0, 0)),
        ("draft model, k=2, sampled at temperature 0.8 from a random seed, in the engine",
         in_the_engine({"method": "draft_model", "num_speculative_tokens": 2}, 0.8, rng.randrange(10**6))),
    ]


@exercise("09.verify_greedy")
def _verify_greedy():
    def case(target_argmax, drafts, want, what):
        def test(verify_greedy):
            got = verify_greedy(list(target_argmax), list(drafts))
            expect(isinstance(got, list) and got == want,
                   f"{what}: verify_greedy({target_argmax}, {drafts}) = {got!r}, expected {want}")
        return test

    def in_the_engine(spec):
        def test(verify_greedy):
            from minivllm.exercises.ch08 import _transformers_greedy, first_divergence
            from minivllm.entrypoints.llm import LLM
            from minivllm.sampling_params import SamplingParams
            from minivllm.spec_decode.engine import SpecDecodeModelRunner

            class ReaderRunner(SpecDecodeModelRunner):
                """The speculative runner, verifying greedy drafts with the reader's rule."""

            ReaderRunner.verify_greedy = staticmethod(verify_greedy)
            llm = LLM(num_kv_blocks=24, max_num_seqs=3, max_num_batched_tokens=64, device="cpu",
                      speculative_config=spec)
            llm.engine.model_runner.__class__ = ReaderRunner  # the engine's runner, with the reader's verification
            prompts = _spec_prompts()
            params = SamplingParams(temperature=0, max_tokens=_SPEC_TOKENS, ignore_eos=True)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            problem = first_divergence([o.outputs[0].token_ids for o in outputs],
                                       _transformers_greedy(prompts, _SPEC_TOKENS), prompts)
            expect(problem is None, f"{spec['method']}, k={spec['num_speculative_tokens']}: {problem}")
            stats = llm.stats()
            expect(stats["spec_decode_num_accepted_tokens"] > 0,
                   f"{spec['method']}: no draft token was ever accepted, so the check proved nothing")
        return test

    return [
        ("every guess agrees: all of them, then the bonus token", case([4, 5, 6, 7], [4, 5, 6], [4, 5, 6, 7], "all")),
        ("the second guess is wrong: the first, then the target's own", case([4, 9, 6, 7], [4, 5, 6], [4, 9], "2nd")),
        ("the first guess is wrong: one token, the target's", case([8, 5, 6], [4, 5], [8], "1st")),
        ("no guesses at all: plain decoding", case([3], [], [3], "none")),
        ("agreement after a miss does not count", case([1, 2, 3, 4], [1, 9, 3], [1, 2], "later")),
        ("draft model, k=3, in the engine: the same tokens as transformers",
         in_the_engine({"method": "draft_model", "num_speculative_tokens": 3})),
        ("n-gram, k=4, in the engine: the same tokens as transformers",
         in_the_engine({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                        "prompt_lookup_min": 2})),
    ]
