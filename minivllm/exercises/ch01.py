"""Chapter 1 exercises: the reader's RMSNorm and rotary embedding are checked on their own, then run inside the
embedded model's decoder (every norm, or every layer's rotation, is theirs) against transformers."""

import copy

import torch
from torch import nn

from minivllm.exercises import case_seed, close, exercise, expect


def _in_the_decoder(replace, what: str, lengths=(23, 9, 40), max_tokens: int = 6):
    """A case that runs a copy of the embedded model whose modules `replace(module, reader_function, config)` swaps
    (None: keeps it) on a
    packed batch of three prompts: its logits for every position against transformers' (each prompt on its own),
    then a greedy continuation of each prompt, recomputed token by token, against transformers' tokens."""
    def test(reader_function):
        from minivllm.attention.base import NoCacheAttention
        from minivllm.book.mechanism_checks import divergence, greedy_reference, passage_prompts, tiny_model

        model, _, hf = tiny_model()
        model = copy.deepcopy(model)
        swapped = 0
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                module = replace(child, reader_function, model.config)
                if module is not None:
                    setattr(parent, name, module)
                    swapped += 1
        expect(swapped > 0, f"no {what} found in the model")
        prompts = passage_prompts(list(lengths))
        with torch.no_grad():
            logits = model.compute_logits(model(*NoCacheAttention.for_sequences(prompts)))
            start = 0
            for i, prompt in enumerate(prompts):
                want = hf(input_ids=torch.tensor([prompt])).logits[0].float()
                got = logits[start:start + len(prompt)]
                start += len(prompt)
                error = float((got - want).abs().max())
                expect(error < 1e-3, f"with your {what} in all {swapped} places, prompt {i} ({len(prompt)} tokens): "
                                     f"logits differ from transformers' by up to {error:.3g}")
            for i, prompt in enumerate(prompts):
                ids = list(prompt)
                for _ in range(max_tokens):
                    hidden = model(*NoCacheAttention.for_sequences([ids]))
                    ids.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
                where = divergence(ids[len(prompt):], greedy_reference(prompt, max_tokens))
                expect(where is None, f"with your {what}, prompt {i}'s greedy tokens part from transformers' at "
                                      f"{where}")
    return test

def _reader_norm(module, rms_norm, config):
    """An RMSNorm's stand-in that normalises with the reader's rms_norm(x, weight, eps)."""
    from minivllm.model.layers import RMSNorm

    if not isinstance(module, RMSNorm):
        return None

    class ReaderRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.eps = module.weight, module.eps

        def forward(self, x):
            return rms_norm(x, self.weight, self.eps)
    return ReaderRMSNorm()


def _reader_rope(module, apply_rope, config):
    """A RotaryEmbedding's stand-in that rotates q and k with the reader's apply_rope(x, positions, theta)."""
    from minivllm.model.layers import RotaryEmbedding

    if not isinstance(module, RotaryEmbedding):
        return None
    theta = config.rope_theta

    class ReaderRotaryEmbedding(nn.Module):
        def forward(self, positions, q, k):
            return apply_rope(q, positions, theta), apply_rope(k, positions, theta)
    return ReaderRotaryEmbedding()


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
        ("in the decoder: every norm of the embedded model (layers, q and k, final) is yours, against transformers",
         _in_the_decoder(_reader_norm, "RMSNorm")),
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
        ("in the decoder: every layer rotates q and k with yours, on a packed batch, against transformers",
         _in_the_decoder(_reader_rope, "rotary embedding")),
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
