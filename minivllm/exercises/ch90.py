"""Appendix exercises: a GGUF file's quantized blocks and llama.cpp's Q/K permutation, on SmolLM2."""

import functools

import numpy as np
import torch

from minivllm.exercises import case_seed, close, exercise, expect


@functools.cache
def _reader():
    from gguf import GGUFReader

    from minivllm.book.real_model import smollm2_gguf

    return GGUFReader(smollm2_gguf())


@exercise("90.dequantize_q4_1")
def _dequantize_q4_1():
    from gguf import GGMLQuantizationType, dequantize

    def case(tensor_name, block_index):
        def test(candidate):
            tensor = next(t for t in _reader().tensors if t.name == tensor_name)
            expect(tensor.tensor_type == GGMLQuantizationType.Q4_1, f"{tensor_name} is not Q4_1")
            raw = tensor.data.reshape(-1)
            block = bytes(raw[20 * block_index:20 * (block_index + 1)])
            expected = dequantize(np.frombuffer(block, dtype=np.uint8), GGMLQuantizationType.Q4_1).reshape(-1)
            got = np.asarray(candidate(block), dtype=np.float32).reshape(-1)
            close(torch.from_numpy(got), torch.from_numpy(expected.astype(np.float32)),
                  f"block {block_index} of {tensor_name}", atol=1e-6)
        return test

    return [(f"block {i} of {name}", case(name, i))
            for name, i in [("blk.0.ffn_down.weight", 0), ("blk.0.ffn_down.weight", 777), ("blk.7.attn_q.weight", 3),
                            ("blk.29.ffn_gate.weight", 12345)]]


def _permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute): two halves -> interleaved pairs."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


@exercise("90.unpermute")
def _unpermute():
    def round_trip(rows, cols, heads):
        def test(candidate):
            weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(case_seed(rows + heads)))
            got = candidate(_permute(weight, heads), heads)
            close(torch.as_tensor(got), weight, f"unpermute(permute(W), {heads}) for W of shape ({rows}, {cols})")
        return test

    def greedy_tokens(candidate):
        import minivllm.model.gguf_loader as loader
        from minivllm.attention.base import NoCacheAttention
        from minivllm.book.real_model import smollm2_gguf

        reference, tokenizer = loader.load_gguf(smollm2_gguf())
        original = loader.unpermute
        loader.unpermute = candidate
        try:
            model, _ = loader.load_gguf(smollm2_gguf())
        finally:
            loader.unpermute = original
        ids = tokenizer("The capital of France is").input_ids
        for step in range(8):
            with torch.no_grad():
                want = int(reference.compute_logits(reference(*NoCacheAttention.for_sequences([ids])))[-1].argmax())
                got = int(model.compute_logits(model(*NoCacheAttention.for_sequences([ids])))[-1].argmax())
            expect(got == want, f"greedy token {step} after {tokenizer.decode(ids)!r}: yours "
                                f"{tokenizer.decode([got])!r}, the reference {tokenizer.decode([want])!r}")
            ids.append(want)

    return [("a round trip with 9 query heads of 64", round_trip(9 * 64, 576, 9)),
            ("a round trip with 3 key heads of 64", round_trip(3 * 64, 576, 3)),
            ("a round trip with 2 heads of 4 rows", round_trip(8, 3, 2)),
            ("SmolLM2 loaded with your unpermute decodes like the reference", greedy_tokens)]
