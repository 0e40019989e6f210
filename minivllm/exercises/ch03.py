"""Chapter 3 exercises."""

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm.exercises import CheckFailed, case_random, case_seed, close, exercise, expect

_BY_HAND = "the exercise asks for attention by hand: scores, softmax and the weighted sum, not a library's attention"


class _NoAttentionFunctions(TorchFunctionMode):
    """Refuses torch's attention functions, however they were imported (F.scaled_dot_product_attention, the
    module behind nn.MultiheadAttention)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.scaled_dot_product_attention, F.multi_head_attention_forward):
            raise CheckFailed(f"{func.__name__} was called: {_BY_HAND}")
        return func(*args, **(kwargs or {}))


class _NoAttentionKernels(TorchDispatchMode):
    """Refuses every fused attention operator at the dispatcher (torch.ops.aten.*scaled_dot_product*)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            raise CheckFailed(f"{func} was called: {_BY_HAND}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def by_hand():
    """Inside, a call of a library attention function or kernel fails the check."""
    with _NoAttentionFunctions(), _NoAttentionKernels():
        yield


def _reader_backend(cache_attend):
    """Chapter 3's backend with the reader's write-and-attend in place of its own."""
    from minivllm.book.contiguous_cache import ContiguousCacheAttention

    class ReaderCacheAttention(ContiguousCacheAttention):
        def attend(self, layer, q, k, v):
            out = cache_attend(self.cache, layer, list(self.rows), list(self.num_cached), list(self.num_new), q, k, v)
            expect(isinstance(out, torch.Tensor) and out.shape == q.shape,
                   f"cache_attend returned {getattr(out, 'shape', type(out).__name__)}, expected a tensor shaped "
                   f"like q, {tuple(q.shape)}")
            return out

    return ReaderCacheAttention


def _model():
    from minivllm import load_model

    return load_model()


@exercise("03.cache_attend")
def _cache_attend():
    from minivllm.book import contiguous_cache
    from minivllm.book.contiguous_cache import ContiguousKVCache
    from minivllm.exercises.harness import GREEDY_PROMPTS, first_divergence, report_speed, swapped
    from minivllm.exercises.harness import transformers_greedy, transformers_model
    from minivllm.sampling_params import SamplingParams

    model, tokenizer = _model()

    def greedy(cache_attend):
        prompts, max_tokens = GREEDY_PROMPTS[:2], 20
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        run = lambda: [contiguous_cache.generate_cached(model, tokenizer(p).input_ids, params) for p in prompts]
        with swapped(contiguous_cache, "ContiguousCacheAttention", _reader_backend(cache_attend)):
            got = [c.token_ids for c in run()]
        problem = first_divergence(got, transformers_greedy(prompts, max_tokens), prompts)
        expect(problem is None, problem)
        with torch.inference_mode():
            def yours():
                with swapped(contiguous_cache, "ContiguousCacheAttention", _reader_backend(cache_attend)):
                    run()
            report_speed(f"generate_cached with your cache, {len(prompts)} prompts x {max_tokens} tokens",
                         yours, run)

    def steps(plan, seed):
        """plan: per step, (sequence, number of new tokens) in batch order; sequence i owns row rows[i] of a cache
        whose rows hold exactly the longest sequence, its slots past each sequence full of junk."""
        def test(cache_attend):
            gen = torch.Generator().manual_seed(case_seed(seed))
            lengths = {}
            for step in plan:
                for seq, new in step:
                    lengths[seq] = lengths.get(seq, 0) + new
            sequences = {seq: torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
                         for seq, n in lengths.items()}
            rows = torch.randperm(len(sequences), generator=gen).tolist()
            cache = ContiguousKVCache.for_model(model, max_seqs=len(sequences), max_len=max(lengths.values()))
            cache.k.normal_(0, 30, generator=gen)
            cache.v.normal_(0, 30, generator=gen)
            backend = _reader_backend(cache_attend)
            with torch.no_grad():
                want = {seq: transformers_model()(torch.tensor([ids]), use_cache=False).logits[0]
                        for seq, ids in sequences.items()}
                done = {seq: 0 for seq in sequences}
                for number, step in enumerate(plan):
                    new_tokens = [sequences[seq][done[seq]:done[seq] + new] for seq, new in step]
                    hidden = model(*backend.for_step(cache, [rows[seq] for seq, _ in step], new_tokens,
                                                     [done[seq] for seq, _ in step]))
                    logits, start = model.compute_logits(hidden), 0
                    for seq, new in step:
                        error = (logits[start:start + new] - want[seq][done[seq]:done[seq] + new]).abs().max().item()
                        expect(error < 1e-3, f"step {number}: sequence {seq} (row {rows[seq]}, tokens {done[seq]}.."
                                             f"{done[seq] + new - 1}): logits differ from transformers' by {error:.2e}")
                        start, done[seq] = start + new, done[seq] + new
        return test

    rng = case_random("03.cache_attend")
    num_seqs = rng.randrange(1, 5)
    drawn, left = [], {seq: rng.randrange(1, 30) for seq in range(num_seqs)}
    while any(left.values()):
        step = [(seq, min(left[seq], rng.choice([1, 1, 3, 8]))) for seq in rng.sample(range(num_seqs), num_seqs)
                if left[seq]]
        for seq, new in step:
            left[seq] -= new
        drawn.append(step)
    return [
        ("greedy generation with your cache: every token is transformers'", greedy),
        ("a prefill, then decodes, one sequence", steps([[(0, 9)], [(0, 1)], [(0, 1)], [(0, 1)]], 1)),
        ("a one-token prompt", steps([[(0, 1)], [(0, 1)]], 2)),
        ("a prompt in two chunks, the second over the cached first", steps([[(0, 6)], [(0, 7)], [(0, 1)]], 3)),
        ("a mixed step: decodes beside a prefill and a chunk, rows out of order, the last slot of a row filled",
         steps([[(1, 5), (0, 8)], [(0, 1), (2, 4), (1, 6)], [(2, 1), (1, 1), (0, 1)], [(1, 1), (0, 1)]], 4)),
        (f"random: {num_seqs} sequences in {len(drawn)} steps", steps(drawn, rng.randrange(1000))),
    ]


@exercise("03.decode_attention")
def _decode_attention():
    from minivllm.attention.base import causal_attention

    def case(num_heads, num_kv_heads, head_dim, max_len, length, seed):
        def test(decode_attention):
            gen = torch.Generator().manual_seed(case_seed(seed))
            q = torch.randn(num_heads, head_dim, generator=gen)
            k_cache = torch.randn(max_len, num_kv_heads, head_dim, generator=gen)
            v_cache = torch.randn(max_len, num_kv_heads, head_dim, generator=gen)
            k_cache[length:] = 1e4  # slots past `length` are stale: reading them is a bug
            v_cache[length:] = 1e4
            expected = causal_attention(q[None], k_cache[:length], v_cache[:length])[0]
            with by_hand():
                got = decode_attention(q, k_cache, v_cache, length)
            close(got, expected, f"{num_heads} heads over {num_kv_heads} kv heads, {length} of {max_len} slots",
                  atol=1e-4, rtol=1e-4)
        return test

    rng = case_random("03.decode_attention")
    kv_heads, group = rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
    max_len = rng.randrange(8, 64)
    return [
        ("multi-head, one cached token", case(4, 4, 8, 6, 1, 0)),
        ("multi-head, a full row", case(4, 4, 16, 12, 12, 1)),
        ("grouped-query: 8 heads over 2 kv heads", case(8, 2, 16, 32, 20, 2)),
        ("multi-query: 6 heads over 1 kv head", case(6, 1, 32, 40, 33, 3)),
        (f"random: {kv_heads * group} heads over {kv_heads} kv heads",
         case(kv_heads * group, kv_heads, rng.choice([8, 16, 32]), max_len, rng.randrange(1, max_len + 1),
              rng.randrange(1000))),
    ]
