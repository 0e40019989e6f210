"""Weight-only int8 (`LLM(quantization="int8_per_channel_weight_only")`, chapter 8b's last section): each linear
layer's weight as int8 rows with one fp32 scale per row (vLLM 0.33.0's per-channel recipe), fp32 activations.

Its correctness is defined in three parts, each checked here:

1. **It computes with the weights it says it has.** The kernel's output equals x times the dequantized weights
   (q * scale) up to fp32 summation order (2^-20 of the largest output), and the engine's greedy tokens equal
   transformers' run on a copy of the checkpoint whose linear weights are replaced by those dequantized weights,
   token for token, on three architectures and the embedded model.
2. **Logits against fp32**: every logit within LOGIT_BOUND = 2^-6 of the largest logit's magnitude, the bound
   bf16 is held to (tests/test_bf16.py): each weight moves by at most half a step, 1/254 of its row's largest
   (measured: at most 0.0082 of it on the embedded model).
3. **Greedy tokens against fp32**: on the book's prompts, equal to fp32 transformers' up to the first step where
   fp32's top two logits are within 2 * LOGIT_BOUND of each other, and the first divergence, if any, is at such a
   step (printed with -s).
"""

import copy
import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.kernels.cpu_attention import builds
from minivllm.kernels.cpu_gemv import GemvLinear
from minivllm.kernels.cpu_int8 import INT8_LINE, Int8Linear, load_cpu_int8, quantize_int8, use_int8
from minivllm.model.decoder import CausalLM
from minivllm.model.loader import load_weights
from tests.test_bf16 import (LOGIT_BOUND, assert_greedy_follows_fp32_up_to_a_near_tie, book_greedy_runs,
                             checkpoint_cases, hf_logits, logits_of)

pytestmark = pytest.mark.skipif(not builds(load_cpu_int8), reason="the int8 GEMV did not build (make install)")
INT8 = "int8_per_channel_weight_only"


def test_the_recipe_is_per_row_symmetric_and_rounds_each_weight_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 64, generator=gen) * torch.logspace(-3, 2, 37)[:, None]
    w[5] = 0.0  # a row of zeros
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (37,)
    assert q.abs().max() <= 127 and (q.abs().amax(dim=1)[torch.arange(37) != 5] == 127).all()  # full range used
    expected = w.abs().amax(dim=1) / 127  # vLLM's Int8OnlineMoEMethod: scales = w.abs().amax(dim=1) / vmax
    assert torch.equal(scale[torch.arange(37) != 5], expected[torch.arange(37) != 5])
    assert (q[5] == 0).all() and scale[5] == 1.0
    step = scale.double()[:, None]  # half a step, and 2^-16 of one for the rounding of w / scale in fp32
    assert ((q.double() * step - w.double()).abs() <= step * (0.5 + 2 ** -16)).all()


@pytest.fixture(scope="module", params=[(), ("-mno-fma",)], ids=["fma-loop", "portable-loop"])
def gemv_int8(request):
    return load_cpu_int8(request.param).gemv_int8


@pytest.mark.parametrize("n, k", [(1, 8), (3, 64), (5, 88), (17, 576), (192, 576), (577, 576), (576, 1536)])
def test_the_kernel_multiplies_by_the_dequantized_weights(gemv_int8, n, k):
    gen = torch.Generator().manual_seed(n * k)
    q, scale = quantize_int8(torch.randn(n, k, generator=gen))
    dequantized = q.double() * scale.double()[:, None]
    for rows in (1, 2, 3, 4, 5, 8, 9, 33):  # every chunk of four rows, and the last chunk's sizes
        x = torch.randn(rows, k, generator=gen)
        exact = x.double() @ dequantized.T
        got = gemv_int8(x, q, scale)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert (got.double() - exact).abs().max() <= 2 ** -20 * exact.abs().max(), (rows, n, k)


def test_the_kernel_reads_strided_activations_as_their_values():
    q, scale = quantize_int8(torch.randn(40, 64))
    x = torch.randn(64, 6)
    gemv_int8 = load_cpu_int8().gemv_int8
    assert torch.equal(gemv_int8(x.T, q, scale), gemv_int8(x.T.contiguous(), q, scale))


@pytest.mark.parametrize("x, q, scale, message", [
    (torch.randn(1, 64), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, dtype=torch.float64), "float32"),
    (torch.randn(1, 64).bfloat16(), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4), "float32"),
    (torch.randn(1, 64), torch.zeros(4, 64), torch.ones(4), "int8"),
    (torch.randn(1, 60), torch.zeros(4, 60, dtype=torch.int8), torch.ones(4), "multiple of 8"),
    (torch.randn(1, 64), torch.zeros(4, 64, dtype=torch.int8), torch.ones(5), r"scale \[N\]"),
    (torch.randn(1, 32), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4), r"x must be \[M, K\]"),
])
def test_the_kernel_refuses_what_it_cannot_compute(x, q, scale, message):
    with pytest.raises(RuntimeError, match=message):
        load_cpu_int8().gemv_int8(x, q, scale)


def test_use_int8_replaces_every_fp32_linear_layer_it_can_and_keeps_the_tied_embedding_in_fp32():
    hf = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 100, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
          "tie_word_embeddings": True}
    model = CausalLM(ModelConfig.from_hf(hf)).eval()
    mlp = model.model.layers[0].mlp
    mlp.up_proj = GemvLinear.sharing(mlp.up_proj)  # as LLM's cpu_gemv option leaves it: a subclass of nn.Linear
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    embedding = model.model.embed_tokens.weight
    swapped = use_int8(model)
    unswapped = [name for name, m in linears.items() if m.in_features % INT8_LINE]  # down_proj: 100 inputs
    assert unswapped and swapped == len(linears) - len(unswapped)
    assert all(isinstance(dict(model.named_modules())[name], Int8Linear) for name in linears if name not in unswapped)
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.q.dtype == torch.int8
    assert model.model.embed_tokens.weight is embedding and embedding.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.weight.shape == (128, 64)
    assert use_int8(model.to(torch.bfloat16)) == 0  # nothing left in fp32 that it takes


@pytest.mark.parametrize("options, message", [
    (dict(quantization="int4"), "quantization = 'int4'"),
    (dict(quantization=INT8, dtype="bfloat16"), "fp32 activations on a CPU"),
])
def test_the_engine_refuses_quantization_it_does_not_have_before_loading_weights(options, message, monkeypatch):
    import minivllm.entrypoints.llm as entry

    monkeypatch.setattr(entry, "use_int8", lambda model: pytest.fail("quantized after a refusal"))
    with pytest.raises(ValueError, match=message):
        LLM(**options)


def test_the_engine_refuses_int8_with_tensor_parallelism_before_starting_workers():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(quantization=INT8, tensor_parallel_size=2)


def dequantized_copy(hf_model):
    """transformers' model with each linear weight that use_int8 takes replaced by q * scale (untied)."""
    copied = copy.deepcopy(hf_model)
    for module in copied.modules():
        if isinstance(module, nn.Linear) and module.in_features % INT8_LINE == 0:
            q, scale = quantize_int8(module.weight)
            module.weight = nn.Parameter(q.float() * scale[:, None])
    return copied


def test_int8_greedy_equals_transformers_on_the_dequantized_weights(checkpoints):
    for folder, prompts in checkpoint_cases(checkpoints):
        hf = dequantized_copy(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
        llm = LLM(str(folder), quantization=INT8, max_num_batched_tokens=16)  # chunks of 16: M > 4 in prefill
        assert sum(isinstance(m, Int8Linear) for m in llm.engine.model.modules()) > 0
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],  # decoded together: M of 2 and 3
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
            assert output.outputs[0].token_ids == want, (folder, len(prompt))


def test_int8_logits_are_within_the_bound_of_fp32(checkpoints):
    for folder, prompts in checkpoint_cases(checkpoints):
        config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        ours = load_weights(folder, config, torch.float32, torch.device("cpu"))
        assert use_int8(ours) > 0
        hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        error = scale = 0.0
        for ids in prompts:
            reference = hf_logits(hf32, ids)
            error = max(error, (logits_of(ours, ids) - reference).abs().max().item())
            scale = max(scale, reference.abs().max().item())
        assert error <= LOGIT_BOUND * scale, (folder.name, error, scale)


def test_int8_greedy_follows_fp32_transformers_up_to_a_near_tie(capsys):
    assert_greedy_follows_fp32_up_to_a_near_tie(book_greedy_runs(LLM(quantization=INT8)), capsys)
