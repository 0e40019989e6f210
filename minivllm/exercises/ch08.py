"""Chapter 8 exercises: the pieces of the kernels' algorithm in plain PyTorch, and one tile of the decode kernel
itself, run in Triton's interpreter."""

import contextlib
import math
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

from minivllm.exercises import CheckFailed, case_random, case_seed, close, exercise, expect
from minivllm.exercises.harness import engine_greedy_matches_transformers, first_divergence, report_speed
from minivllm.exercises.harness import transformers_greedy as _transformers_greedy  # noqa: F401 (chapter 9's)


def _attention(q, k, v):
    """softmax(q . k / sqrt(d)) . v for one query vector q [d] over keys k, values v [n, d]."""
    weights = torch.softmax(k.double() @ q.double() / math.sqrt(q.shape[-1]), dim=0)
    return weights @ v.double()


_METADATA = {torch.Tensor.__len__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
             torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.is_floating_point, torch.Tensor.new_zeros,
             torch.Tensor.new_empty, torch.Tensor.new_ones, torch.Tensor.new_full}  # reads no keys
_SPLITS = {torch.Tensor.split, torch.split, torch.Tensor.unbind, torch.unbind}


class TileView(torch.Tensor):
    """Keys or values that may be read one tile at a time: k[i], k[a:b] with b - a <= tile, k.split(tile) and
    their shapes. Any other use (k @ q, k.T, softmax over k, a longer slice) reads beyond a tile and fails."""

    tile: int
    what: str

    @classmethod
    def of(cls, tensor: torch.Tensor, tile: int, what: str) -> "TileView":
        view = tensor.as_subclass(cls)
        view.tile, view.what = tile, what
        return view

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        view = next(a for a in args if isinstance(a, TileView))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        if func in _METADATA:
            return result
        if func is torch.Tensor.__getitem__:
            first = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
            rows = 1 if isinstance(first, int) or (torch.is_tensor(first) and first.dim() == 0) else (
                view.shape[0] if first is Ellipsis or first is None or result.dim() == 0 else result.shape[0])
            pieces = [rows]
        elif func in _SPLITS:
            pieces = [piece.shape[0] if piece.dim() == view.dim() else 1 for piece in result]
        else:
            raise CheckFailed(f"{func.__name__ if hasattr(func, '__name__') else func} read all {view.shape[0]} "
                              f"{view.what} at once: online softmax reads at most one tile ({view.tile}) at a time")
        expect(max(pieces, default=0) <= view.tile, f"a read of {max(pieces)} {view.what} at once, more than one "
                                                   f"tile of {view.tile}")
        return result


class _NoWholeRow(TorchFunctionMode):
    """Fails any tensor the reader builds with a dimension of num_keys: all the scores (or keys) at once, e.g.
    tiles read one by one and put back together."""

    def __init__(self, num_keys: int):
        super().__init__()
        self.num_keys = num_keys

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for out in result if isinstance(result, (tuple, list)) else [result]:
            if torch.is_tensor(out) and self.num_keys in out.shape:
                raise CheckFailed(f"{getattr(func, '__name__', func)} built a tensor of shape {tuple(out.shape)}: all "
                                  f"{self.num_keys} keys at once, where online softmax keeps one tile of scores")
        return result


@exercise("08.online_softmax")
def _online_softmax():
    def case(num_keys, tile, head_dim=16, scale=1.0, seed=0):
        def test(online_attention):
            gen = torch.Generator().manual_seed(case_seed(seed))
            q = torch.randn(head_dim, generator=gen, dtype=torch.float64) * scale
            k = torch.randn(num_keys, head_dim, generator=gen, dtype=torch.float64) * scale
            v = torch.randn(num_keys, head_dim, generator=gen, dtype=torch.float64)
            views = TileView.of(k, tile, "keys"), TileView.of(v, tile, "values")
            with _NoWholeRow(num_keys) if num_keys > tile else contextlib.nullcontext():
                got = online_attention(q, *views, tile)
            close(got, _attention(q, k, v), f"{num_keys} keys in tiles of {tile}", atol=1e-9, rtol=1e-9)
        return test

    rng = case_random("08.online_softmax")
    num_keys, tile = rng.choice([n for n in range(17, 90) if n != 16]), rng.randrange(3, 16)

    return [
        ("keys a whole number of tiles", case(64, 16)),
        ("a last tile that is only partly filled", case(37, 16)),
        ("fewer keys than one tile", case(5, 16)),
        ("one key", case(1, 8)),
        ("scores large enough to overflow exp() without the running max", case(50, 8, scale=40.0)),
        (f"random: {num_keys} keys in tiles of {tile}", case(num_keys, tile, scale=4.0, seed=rng.randrange(1000))),
    ]


def _partials(num_keys, split, head_dim, seed):
    gen = torch.Generator().manual_seed(case_seed(seed))
    q = torch.randn(head_dim, generator=gen, dtype=torch.float64) * 3
    k = torch.randn(num_keys, head_dim, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(num_keys, head_dim, generator=gen, dtype=torch.float64)

    def part(keys, values):
        if len(keys) == 0:  # an empty split: nothing seen, by convention output 0 and log-sum-exp -inf
            return torch.zeros(head_dim, dtype=torch.float64), torch.tensor(-math.inf, dtype=torch.float64)
        scores = keys @ q / math.sqrt(head_dim)
        return torch.softmax(scores, 0) @ values, torch.logsumexp(scores, 0)

    full_out, full_lse = part(k, v)
    return part(k[:split], v[:split]), part(k[split:], v[split:]), (full_out, full_lse)


@exercise("08.merge_partials")
def _merge_partials():
    def case(num_keys, split, head_dim=8, seed=0):
        def test(merge_partials):
            (o1, lse1), (o2, lse2), (want_out, want_lse) = _partials(num_keys, split, head_dim, seed)
            got = merge_partials(o1, lse1, o2, lse2)
            expect(isinstance(got, tuple) and len(got) == 2, "return a pair (output, log-sum-exp)")
            close(got[0], want_out, f"merged output of {split} + {num_keys - split} keys", atol=1e-9, rtol=1e-9)
            close(got[1], want_lse, f"merged log-sum-exp of {split} + {num_keys - split} keys", atol=1e-9,
                  rtol=1e-9)
        return test

    return [
        ("two halves", case(40, 20)),
        ("a short first part and a long second one", case(40, 3, seed=1)),
        ("one key in each part", case(2, 1, seed=2)),
        ("an empty second part (a split past the end of a short sequence)", case(12, 12, seed=3)),
        ("an empty first part", case(12, 0, seed=4)),
    ]


@exercise("08.prefill_key_range")
def _prefill_key_range():
    def key_range(seq_len, query_len, tile, block_m):
        first = tile * block_m
        if first >= query_len:
            return 0
        return seq_len - query_len + min(first + block_m, query_len)

    def case(seq_len, query_len, tile, block_m):
        def test(prefill_key_range):
            want = key_range(seq_len, query_len, tile, block_m)
            got = prefill_key_range(seq_len, query_len, tile, block_m)
            expect(got == want, f"prefill_key_range(seq_len={seq_len}, query_len={query_len}, tile={tile}, "
                                f"block_m={block_m}) = {got}, expected {want}")
        return test

    return [
        ("a fresh prompt, first tile", case(100, 100, 0, 16)),
        ("a fresh prompt, last (partial) tile", case(100, 100, 6, 16)),
        ("a chunk over a cached prefix", case(530, 30, 1, 16)),
        ("a decode: one query after 40 cached tokens", case(41, 1, 0, 16)),
        ("the last, partly filled tile of a long chunk", case(1000, 500, 31, 16)),
    ]


def _interpreted_kernel_module():
    """chapter 8's exercise kernel, defined in Triton's interpreter; None if triton was imported before the
    interpreter could be switched on (or a CUDA GPU compiles kernels here)."""
    import os

    from minivllm.kernels.interpreter import triton_available, use_interpreter_without_gpu

    if not triton_available() or not use_interpreter_without_gpu() or os.environ.get("TRITON_INTERPRET") != "1":
        return None
    from minivllm.book import decode_tile

    return decode_tile


def _run_tile_update(tile_update, *args, **kwargs):
    """The exercise kernel with the reader's tile update; a stub's NotImplementedError comes out as itself."""
    module = _interpreted_kernel_module()
    if module is None:
        tile_update(None, None, None, None, None)  # a stub says so here
        expect(False, "this check runs the kernel in Triton's interpreter: call "
                      "minivllm.kernels.interpreter.use_interpreter_without_gpu() before anything imports triton "
                      "(on a CUDA machine, start Python with TRITON_INTERPRET=1)")
    from triton.runtime.errors import InterpreterError

    try:
        return module.decode_with_tile_update(tile_update, *args, **kwargs)
    except InterpreterError as error:
        if isinstance(error.__cause__, NotImplementedError):
            raise NotImplementedError from None
        cause = error.__cause__ or error
        raise CheckFailed(f"the kernel failed inside your tile update: {type(cause).__name__}: {cause}") from None


def _paged_decode_batch(seq_lens, block_size, num_heads, num_kv_heads, head_dim=32, seed=0):
    """A random paged cache, its blocks in shuffled order, and one decode step for sequences of seq_lens."""
    from minivllm.attention.paged import PagedAttention, PagedKVCache

    gen = torch.Generator().manual_seed(case_seed(seed))
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    shape = SimpleNamespace(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim)
    cache = PagedKVCache(shape, sum(blocks), block_size)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    free = torch.randperm(sum(blocks), generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] + [0] * (max(blocks) - n) for n in blocks]
    slots = [tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size for i, n in enumerate(seq_lens)]
    metadata = PagedAttention(cache, torch.tensor(slots), torch.arange(len(seq_lens) + 1), torch.tensor(seq_lens),
                              torch.tensor(tables, dtype=torch.int32))
    q, k, v = (torch.randn(len(seq_lens), heads, head_dim, generator=gen)
               for heads in (num_heads, num_kv_heads, num_kv_heads))
    return metadata, q, metadata.attend(0, q, k, v)  # the reference writes this step's k, v, then attends


def _reference_tile_update():
    """The engine's own tile update (the kernels' online-softmax step), for the speed report."""
    import triton.language as tl

    def tile_update(m, l, acc, scores, v):
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)

    return tile_update


@exercise("08.tile_update")
def _tile_update():
    def against_reference(seq_lens, block_size, group, block_n, seed, timed=False):
        def test(tile_update):
            ref, q, expected = _paged_decode_batch(seq_lens, block_size, 2 * group, 2, seed=seed)
            k_cache, v_cache = ref.kv_cache.layer(0)
            run = lambda update: _run_tile_update(update, q, k_cache, v_cache, ref.block_tables, ref.seq_lens,
                                                  block_n=block_n)
            got = run(tile_update)
            expect(isinstance(got, torch.Tensor), "the kernel did not produce a tensor")
            for i, n in enumerate(seq_lens):
                error = (got[i] - expected[i]).abs().max().item()
                expect(error < 1e-4, f"sequence {i} ({n} keys, tiles of {block_n}, blocks of {block_size}): "
                                     f"max abs difference {error:.2e} from chapter 5's reference")
            if timed:
                report_speed("the kernel with your tile update, in the interpreter", lambda: run(tile_update),
                             lambda: run(_reference_tile_update()))
        return test

    def engine_greedy(tile_update):
        from minivllm.attention.paged import PagedAttention

        class ReaderDecodeAttention(PagedAttention):
            """Chapter 5's backend whose decodes go through the exercise kernel with the reader's tile update."""

            def _decode(self, q, k_cache, v_cache, block_tables, seq_lens):
                return _run_tile_update(tile_update, q, k_cache, v_cache, block_tables, seq_lens, block_n=16)

        engine_greedy_matches_transformers(ReaderDecodeAttention)

    return [
        ("one tile, one key (the running max starts at -inf)", against_reference([1, 7], 4, 1, 16, 0)),
        ("several tiles over scattered blocks, 2 query heads per kv head",
         against_reference([5, 16, 17, 50], 4, 2, 16, 1)),
        ("tiles that span blocks, partly filled last tiles, 4 query heads per kv head",
         against_reference([31, 64, 70], 8, 4, 16, 2, timed=True)),
        ("the engine's greedy decode with your kernel matches transformers, 3 requests x 12 tokens", engine_greedy),
    ]
