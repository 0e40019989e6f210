"""Chapter 8b exercises: the CPU backend's split of a step into kinds of segment, and the C++ decode kernel's
computation written with tensors, checked against chapter 5's reference and, in the engine, against transformers."""

import torch

from minivllm.exercises import exercise, expect
from minivllm.exercises.ch08 import _paged_decode_batch
from minivllm.exercises.harness import engine_greedy_matches_transformers, report_speed


def _kinds(query_start_loc, seq_lens):
    """The split CPUPagedAttention makes: one token is a decode; a segment that is the whole sequence is fresh."""
    kinds = []
    for i, seq_len in enumerate(seq_lens):
        query_len = query_start_loc[i + 1] - query_start_loc[i]
        kinds.append("decode" if query_len == 1 else "fresh prefill" if query_len == seq_len else "chunk over a cache")
    return kinds


@exercise("08b.segment_kinds")
def _segment_kinds():
    def case(query_start_loc, seq_lens):
        def test(segment_kinds):
            want = _kinds(query_start_loc, seq_lens)
            got = segment_kinds(list(query_start_loc), list(seq_lens))
            expect(isinstance(got, (list, tuple)) and len(got) == len(want),
                   f"segment_kinds({query_start_loc}, {seq_lens}) = {got!r}: expected a list of {len(want)} strings")
            for i, (mine, right) in enumerate(zip(got, want)):
                expect(mine == right, f"sequence {i} (tokens {query_start_loc[i]}..{query_start_loc[i + 1]} of the step, "
                                      f"{seq_lens[i]} after it): {mine!r}, expected {right!r}")
        return test

    return [
        ("a decode-only step", case([0, 1, 2, 3], [17, 40, 5])),
        ("a prompt that arrives whole is a fresh prefill", case([0, 12], [12])),
        ("a later chunk of a prompt runs over its cached first chunk", case([0, 8], [24])),
        ("a mixed step: a decode, a fresh prefill, a chunk", case([0, 1, 9, 25], [30, 8, 40])),
        ("a one-token prompt is a decode (the kernel takes it: one query over one key)", case([0, 1, 4], [1, 3])),
        ("a last chunk of one token is a decode too", case([0, 1], [33])),
    ]


def _as_output(got, q):
    expect(isinstance(got, torch.Tensor), f"returned {type(got).__name__}, expected a tensor")
    expect(got.shape == q.shape, f"output shape {tuple(got.shape)}, expected {tuple(q.shape)} (like q)")
    return got


@exercise("08b.paged_decode")
def _paged_decode():
    def against_reference(seq_lens, block_size, group, seed, timed=False):
        def test(paged_decode_torch):
            ref, q, expected = _paged_decode_batch(seq_lens, block_size, 2 * group, 2, seed=seed)
            k_cache, v_cache = ref.kv_cache.layer(0)
            args = q, k_cache, v_cache, ref.block_tables, ref.seq_lens
            got = _as_output(paged_decode_torch(*args), q)
            for i, n in enumerate(seq_lens):
                error = (got[i] - expected[i]).abs().max().item()
                expect(error < 1e-4, f"sequence {i} of {n} tokens (blocks of {block_size}, query heads per kv "
                                     f"head: {group}): max abs difference {error:.2e} from chapter 5's reference")
            if timed:
                from minivllm.attention.cpu_backend import CPUPagedAttention

                report_speed("your decode against the CPU backend's kernel, 5 repeats",
                             lambda: [paged_decode_torch(*args) for _ in range(5)],
                             lambda: [CPUPagedAttention.decode(*args) for _ in range(5)])
        return test

    def engine_greedy(paged_decode_torch):
        from minivllm.attention.cpu_backend import CPUPagedAttention

        class ReaderCPUAttention(CPUPagedAttention):
            """The CPU backend with the reader's function as its decode kernel."""

            decode = staticmethod(paged_decode_torch)

        engine_greedy_matches_transformers(ReaderCPUAttention)

    return [
        ("one sequence of one token", against_reference([1], 4, 1, 0)),
        ("lengths at block edges, one query head per kv head", against_reference([3, 4, 5, 13], 4, 1, 1)),
        ("blocks of one token, 2 query heads per kv head", against_reference([1, 6, 9], 1, 2, 2)),
        ("a short sequence beside a long one (no padding may leak in), 4 query heads per kv head",
         against_reference([2, 70], 8, 4, 3, timed=True)),
        ("the engine's greedy decode with your kernel matches transformers, 3 requests x 12 tokens", engine_greedy),
    ]
