"""Checks for the book's implementation exercises.

    from minivllm.exercises import check
    check("01.rms_norm", rms_norm)

runs behaviour tests against a reader's function and prints, for each, whether it passed and why
not. It returns True when all passed. Each exercise is registered below with `@exercise`, named
"<chapter>.<name>"; `EXERCISES` lists them.
"""

from __future__ import annotations

import traceback
from typing import Callable

import torch

EXERCISES: dict[str, Callable] = {}


def exercise(name: str):
    def register(suite):
        EXERCISES[name] = suite
        return suite

    return register


class CheckFailed(AssertionError):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def close(actual, expected, what: str, atol=1e-5, rtol=1e-5) -> None:
    actual = torch.as_tensor(actual)
    expect(actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    error = (actual.double() - expected.double()).abs().max().item()
    expect(torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol),
           f"{what}: max abs difference {error:.2e} from the reference")


def check(name: str, candidate) -> bool:
    """Run exercise `name`'s behaviour tests against `candidate`; print a report; True if all passed."""
    if name not in EXERCISES:
        raise KeyError(f"no exercise {name!r}; known: {', '.join(sorted(EXERCISES))}")
    cases = list(EXERCISES[name]())
    passed = 0
    for description, test in cases:
        try:
            test(candidate)
        except NotImplementedError:
            print(f"✗ {name}: not implemented yet (the function raises NotImplementedError)")
            return False
        except CheckFailed as failure:
            print(f"✗ {description}: {failure}")
        except Exception as error:  # a crash in the reader's code is a failed check, shown where it happened
            frame = traceback.extract_tb(error.__traceback__)[-1]
            print(f"✗ {description}: {type(error).__name__}: {error} (line {frame.lineno} of {frame.name})")
        else:
            passed += 1
            print(f"✓ {description}")
    if passed == len(cases):
        print(f"{name}: all {len(cases)} checks passed")
        return True
    print(f"{name}: {passed} of {len(cases)} checks passed")
    return False


# ---------------------------------------------------------------- chapter 0

@exercise("00.parameter_count")
def _parameter_count():
    from minivllm.config import ModelConfig
    from minivllm.model import CausalLM

    base = dict(architectures=["Qwen3ForCausalLM"], vocab_size=100, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                tie_word_embeddings=True)
    variants = {
        "tiny Qwen3, tied embeddings": base,
        "untied embeddings": {**base, "tie_word_embeddings": False},
        "head_dim * heads != hidden_size": {**base, "head_dim": 16},
        "Qwen2 (q/k/v biases, no q/k norms)": {**base, "architectures": ["Qwen2ForCausalLM"], "head_dim": None},
        "Llama with attention and MLP biases": {**base, "architectures": ["LlamaForCausalLM"],
                                                "attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1},
    }

    def case(hf):
        def test(parameter_count):
            cfg = {k: v for k, v in hf.items() if v is not None}
            want = sum(p.numel() for p in CausalLM(ModelConfig.from_hf(cfg)).parameters())
            got = parameter_count(dict(cfg))
            expect(got == want, f"returned {got:,}, the model has {want:,}")
        return test

    return [(f"parameter_count: {what}", case(hf)) for what, hf in variants.items()]


# ---------------------------------------------------------------- chapter 1

@exercise("01.rms_norm")
def _rms_norm():
    from minivllm.layers import RMSNorm

    def case(shape, eps, dtype=torch.float32):
        def test(rms_norm):
            gen = torch.Generator().manual_seed(sum(shape))
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
    from minivllm.layers import RotaryEmbedding

    def reference(x, positions, theta):
        class Cfg:
            head_dim, rope_theta, rope_scaling, max_model_len = x.shape[-1], theta, None, int(positions.max()) + 1
        rope = RotaryEmbedding(Cfg)
        return rope(positions, x, x)[0]

    def case(tokens, heads, head_dim, theta, positions=None):
        def test(apply_rope):
            gen = torch.Generator().manual_seed(tokens * heads + head_dim)
            x = torch.randn(tokens, heads, head_dim, generator=gen)
            pos = torch.arange(tokens) if positions is None else torch.tensor(positions)
            close(apply_rope(x, pos, theta), reference(x, pos, theta), f"{tokens}x{heads}x{head_dim}", atol=1e-4)
        return test

    def relative(apply_rope):
        gen = torch.Generator().manual_seed(7)
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
            p = torch.randn(500, generator=torch.Generator().manual_seed(3)).mul(3).softmax(-1)
            close(top_p_filter(p.clone(), top_p), reference(p, top_p), f"500 tokens, top_p={top_p}", atol=1e-6)
        return test

    return [
        ("top_p = 1 keeps everything", case([0.5, 0.3, 0.2], 1.0, "top_p=1")),
        ("keeps the smallest set reaching top_p", case([0.1, 0.6, 0.3], 0.8, "[0.1, 0.6, 0.3], 0.8")),
        ("the top token always survives", case([0.2, 0.7, 0.1], 0.05, "top_p smaller than any probability")),
        ("unsorted input keeps its order", case([0.05, 0.15, 0.4, 0.1, 0.3], 0.6, "unsorted")),
        ("a realistic distribution", random_case(0.9)),
    ]


# ---------------------------------------------------------------- chapter 2

@exercise("02.linear_intensity")
def _linear_intensity():
    def reference(tokens, d_in, d_out, bytes_per_element):
        flops = 2 * tokens * d_in * d_out
        moved = bytes_per_element * (d_in * d_out + tokens * d_in + tokens * d_out)
        return flops / moved

    def case(*args):
        def test(linear_intensity):
            got, want = float(linear_intensity(*args)), reference(*args)
            expect(abs(got - want) <= 1e-6 * want, f"linear_intensity{args} = {got:.4f}, expected {want:.4f}")
        return test

    return [
        ("decode: one token, fp32", case(1, 4096, 4096, 4)),
        ("decode: one token, bf16", case(1, 4096, 11008, 2)),
        ("prefill: 512 tokens", case(512, 4096, 4096, 2)),
        ("a batch of 64 decodes", case(64, 1024, 3072, 2)),
    ]


@exercise("02.ttft_tpot")
def _ttft_tpot():
    def case(arrival, token_times, want):
        def test(ttft_tpot):
            got = ttft_tpot(arrival, list(token_times))
            expect(len(got) == 2, "return (ttft, tpot)")
            ok = all((g is None and w is None) or (g is not None and w is not None and abs(g - w) < 1e-9)
                     for g, w in zip(got, want))
            expect(ok, f"ttft_tpot({arrival}, {token_times}) = {got}, expected {want}")
        return test

    return [
        ("evenly spaced tokens", case(10.0, [10.5, 10.6, 10.7, 10.8], (0.5, 0.1))),
        ("uneven decode steps", case(0.0, [2.0, 3.0, 3.5, 6.0], (2.0, 4.0 / 3))),
        ("two tokens", case(1.0, [1.25, 2.0], (0.25, 0.75))),
        ("a single token has no TPOT", case(5.0, [7.0], (2.0, None))),
    ]
