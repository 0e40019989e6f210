"""Int8 weights (`LLM(quantization="int8_per_channel_weight_only")`, chapter 8b's last section): each linear
layer's weight as int8 rows with one fp32 scale per row (vLLM 0.33.0's per-channel recipe), fp32 activations
that the kernel rounds per row to int16 steps (max |row| / 32767) so that the products are integer sums (VNNI).

Its correctness is defined in three parts, each checked here:

1. **It computes with the numbers it says it has.** The kernel's output equals x, rounded as the kernel rounds it
   (round_to_int16_steps), times the dequantized weights (q * scale), within 2^-20 of the largest output; the
   VNNI loop and the portable loop give the same bits; and the engine's greedy tokens equal transformers' run on
   a copy of the checkpoint whose linear weights are replaced by those dequantized weights and whose linear
   layers round their inputs the same way, token for token, on three architectures and the embedded model.
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
from minivllm.kernels.cpu_gemv import GemvLinear
from minivllm.kernels.cpu_int8 import Int8Linear, load_cpu_int8, quantize_int8, round_to_int16_steps, use_int8
from minivllm.model.decoder import CausalLM
from minivllm.model.loader import load_weights
from tests.conftest import kernel_missing
from tests.test_bf16 import (LOGIT_BOUND, assert_greedy_follows_fp32_up_to_a_near_tie, book_greedy_runs,
                             checkpoint_cases, hf_logits, logits_of)

pytestmark = pytest.mark.skipif(kernel_missing(load_cpu_int8), reason="no C++ compiler here, or the kernels are off")
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


PORTABLE = "portable"  # the build without the VNNI loop (and without AVX2)
WIDTHS = [(1, 8), (3, 64), (5, 88), (9, 33), (17, 576), (192, 576), (577, 576), (7, 1000), (576, 1536)]


@pytest.fixture(scope="module", params=[None, PORTABLE], ids=["this-cpu", "portable-loop"])
def gemv_int8(request):
    return load_cpu_int8(request.param).gemv_int8


@pytest.mark.parametrize("n, k", WIDTHS)  # widths past a chunk of 512, and tails of 1 to 63 under the mask
def test_the_kernel_multiplies_the_rounded_rows_by_the_dequantized_weights(gemv_int8, n, k):
    gen = torch.Generator().manual_seed(n * k)
    q, scale = quantize_int8(torch.randn(n, k, generator=gen))
    dequantized = q.double() * scale.double()[:, None]
    for rows in (1, 2, 3, 4, 5, 8, 9, 33):  # every chunk of four rows, and the last chunk's sizes
        x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, rows)[:, None]  # each row its own steps
        got = gemv_int8(x, q, scale).double()
        assert got.shape == (rows, n)
        exact = round_to_int16_steps(x).double() @ dequantized.T
        assert (got - exact).abs().max() <= 2 ** -20 * exact.abs().max(), (rows, n, k)
        half_step = x.abs().amax(dim=1, keepdim=True).double() / 32767 / 2  # what rounding moves an input by
        unrounded = x.double() @ dequantized.T
        assert ((got - unrounded).abs() <= half_step * dequantized.abs().sum(dim=1) + 2 ** -20 * exact.abs().max()).all()


@pytest.mark.skipif(kernel_missing(load_cpu_int8) or not load_cpu_int8().has_vnni(),
                    reason="no AVX-512 VNNI here: one loop only")
@pytest.mark.parametrize("n, k", WIDTHS)
def test_the_vnni_loop_and_the_portable_loop_give_the_same_bits(n, k):
    gen = torch.Generator().manual_seed(n + k)
    q, scale = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(6, k, generator=gen)
    assert not load_cpu_int8(PORTABLE).has_vnni()
    assert torch.equal(load_cpu_int8().gemv_int8(x, q, scale), load_cpu_int8(PORTABLE).gemv_int8(x, q, scale))


def test_integer_sums_past_int32_do_not_overflow(gemv_int8):
    k = 4096  # 4096 x 127 x 32767 is about 8 x 2^31: only chunked sums get this right
    q, scale = torch.full((3, k), 127, dtype=torch.int8), torch.tensor([1.0, 0.5, 2.0])
    x = torch.stack([torch.full((k,), 1.5), torch.full((k,), -1.5)])
    got = gemv_int8(x, q, scale).double()
    expected = torch.tensor([[1.5], [-1.5]], dtype=torch.float64) * (k * 127) * scale.double()
    assert torch.allclose(got, expected, rtol=2 ** -20, atol=0)


def test_a_row_with_a_nan_or_an_infinity_gives_nan_and_the_other_rows_their_values(gemv_int8):
    q, scale = quantize_int8(torch.randn(5, 40))
    x = torch.randn(4, 40)
    x[1, 7], x[3, 0] = float("nan"), float("inf")
    got = gemv_int8(x, q, scale)
    assert got[[1, 3]].isnan().all()
    assert torch.equal(got[[0, 2]], gemv_int8(x[[0, 2]], q, scale))


def test_the_kernel_reads_strided_activations_as_their_values():
    q, scale = quantize_int8(torch.randn(40, 64))
    x = torch.randn(64, 6)
    gemv_int8 = load_cpu_int8().gemv_int8
    assert torch.equal(gemv_int8(x.T, q, scale), gemv_int8(x.T.contiguous(), q, scale))


@pytest.mark.parametrize("x, q, scale, message", [
    (torch.randn(1, 64), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, dtype=torch.float64), "float32"),
    (torch.randn(1, 64).bfloat16(), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4), "float32"),
    (torch.randn(1, 64), torch.zeros(4, 64), torch.ones(4), "int8"),
    (torch.randn(1, 2, 64), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4), r"x must be \[M, K\]"),
    (torch.randn(1, 64), torch.zeros(4, 64, dtype=torch.int8), torch.ones(5), r"scale \[N\]"),
    (torch.randn(1, 32), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4), r"x must be \[M, K\]"),
])
def test_the_kernel_refuses_what_it_cannot_compute(x, q, scale, message):
    with pytest.raises(RuntimeError, match=message):
        load_cpu_int8().gemv_int8(x, q, scale)


def test_use_int8_replaces_every_fp32_linear_layer_and_keeps_the_tied_embedding_in_fp32():
    hf = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 100, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
          "tie_word_embeddings": True}
    model = CausalLM(ModelConfig.from_hf(hf)).eval()
    mlp = model.model.layers[0].mlp
    mlp.up_proj = GemvLinear.sharing(mlp.up_proj)  # as LLM's cpu_gemv option leaves it: a subclass of nn.Linear
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    embedding = model.model.embed_tokens.weight
    assert use_int8(model) == len(linears)  # down_proj's 100 inputs too: any width
    assert all(isinstance(dict(model.named_modules())[name], Int8Linear) for name in linears)
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
    """transformers' model with each linear weight replaced by q * scale (untied), each linear layer's input
    rounded as the kernel rounds it."""
    copied = copy.deepcopy(hf_model)
    for module in copied.modules():
        if isinstance(module, nn.Linear):
            q, scale = quantize_int8(module.weight)
            module.weight = nn.Parameter(q.float() * scale[:, None])
            module.register_forward_pre_hook(lambda module, args: (round_to_int16_steps(args[0]),))
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


def test_int8_linear_takes_activations_of_any_leading_shape():
    layer = Int8Linear(nn.Linear(48, 20, bias=True))
    x = torch.randn(2, 3, 48)
    flat = layer(x.reshape(6, 48))
    assert flat.shape == (6, 20)
    assert torch.equal(layer(x), flat.view(2, 3, 20)) and torch.equal(layer(x[0, 0]), flat[0])


def test_int8_linear_runs_its_hooks_once_per_call_whatever_the_shape():
    layer, calls = Int8Linear(nn.Linear(16, 8)), []
    layer.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    layer(torch.randn(2, 3, 16))
    assert calls == [(2, 3, 8)]
