"""Chapter 1 exercises."""

import torch

from minivllm.exercises import case_seed, close, exercise, expect

@exercise("01.rms_norm")
def _rms_norm():
    from minivllm.model.layers import RMSNorm

    def case(shape, eps, dtype=torch.float32):
        def test(rms_norm):
            gen = torch.Generator().manual_seed(case_seed(sum(shape)))
            x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
            weight = torch.randn(shape[-1], generator=gen).to(dtype)
            norm = RMSNorm(shape[-1], eps).to(dtype)
            norm.weight.data.copy_(weight)
            with torch.no_grad():
                expected = norm(x)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            close(rms_norm(x, weight, eps), expected, f"shape {shape}, {dtype}", atol=tol, rtol=tol)
        return test

    return [
        ("a single vector", case((16,), 1e-6)),
        ("a batch of tokens", case((5, 64), 1e-6)),
        ("[tokens, heads, head_dim]", case((3, 4, 32), 1e-5)),
        ("a large eps matters", case((4, 8), 10.0)),
        ("bfloat16 input (statistics in float32)", case((6, 128), 1e-6, torch.bfloat16)),
    ]


@exercise("01.apply_rope")
def _apply_rope():
    from minivllm.model.layers import RotaryEmbedding

    def reference(x, positions, theta):
        class Cfg:
            head_dim, rope_theta, rope_scaling, max_model_len = x.shape[-1], theta, None, int(positions.max()) + 1
        rope = RotaryEmbedding(Cfg)
        return rope(positions, x, x)[0]

    def case(tokens, heads, head_dim, theta, positions=None):
        def test(apply_rope):
            gen = torch.Generator().manual_seed(case_seed(tokens * heads + head_dim))
            x = torch.randn(tokens, heads, head_dim, generator=gen)
            pos = torch.arange(tokens) if positions is None else torch.tensor(positions)
            close(apply_rope(x, pos, theta), reference(x, pos, theta), f"{tokens}x{heads}x{head_dim}", atol=1e-4)
        return test

    def relative(apply_rope):
        gen = torch.Generator().manual_seed(case_seed(7))
        q, k = torch.randn(1, 1, 64, generator=gen), torch.randn(1, 1, 64, generator=gen)
        dots = [(apply_rope(q, torch.tensor([m]), 10000.0) * apply_rope(k, torch.tensor([m - 5]), 10000.0)).sum()
                for m in (5, 17, 300)]
        expect(all(abs(d - dots[0]) < 1e-3 for d in dots),
               f"q·k at distance 5 should not depend on the absolute position: {[round(float(d), 4) for d in dots]}")

    return [
        ("positions 0..n-1", case(6, 2, 16, 10000.0)),
        ("a larger theta", case(5, 3, 64, 1_000_000.0)),
        ("arbitrary positions (a packed batch)", case(4, 1, 8, 10000.0, positions=[7, 0, 3, 100])),
        ("position 0 leaves x unchanged", case(1, 2, 32, 10000.0, positions=[0])),
        ("dot products depend only on distance", relative),
    ]


@exercise("01.top_p_filter")
def _top_p_filter():
    def reference(probs, top_p):
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        kept = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        return kept / kept.sum()

    def case(probs, top_p, what):
        def test(top_p_filter):
            p = torch.tensor(probs)
            close(top_p_filter(p.clone(), top_p), reference(p, top_p), what, atol=1e-6)
        return test

    def random_case(top_p):
        def test(top_p_filter):
            p = torch.randn(500, generator=torch.Generator().manual_seed(case_seed(3))).mul(3).softmax(-1)
            close(top_p_filter(p.clone(), top_p), reference(p, top_p), f"500 tokens, top_p={top_p}", atol=1e-6)
        return test

    return [
        ("top_p = 1 keeps everything", case([0.5, 0.3, 0.2], 1.0, "top_p=1")),
        ("keeps the smallest set reaching top_p", case([0.1, 0.6, 0.3], 0.8, "[0.1, 0.6, 0.3], 0.8")),
        ("the top token always survives", case([0.2, 0.7, 0.1], 0.05, "top_p smaller than any probability")),
        ("unsorted input keeps its order", case([0.05, 0.15, 0.4, 0.1, 0.3], 0.6, "unsorted")),
        ("a realistic distribution", random_case(0.9)),
    ]
