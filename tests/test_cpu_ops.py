"""Chapter 8b's C++ norm and rotation (`minivllm/kernels/cpu_ops.py`, the layers in `minivllm/model/cpu_layers.py`), which `LLM(cpu_ops="auto")` puts in place of
chapter 1's `RMSNorm` and `RotaryEmbedding` on a CPU.

- **`rms_norm`** against chapter 1's `RMSNorm` on the same rows, 2-D and 3-D (Qwen3's per-head q/k norms): fp32
  within 2^-20 of the largest output (it adds its squares in another order than `torch.mean`); bf16 within one
  bf16 rounding step (2^-8 of it).
- **`rotary_`** equals chapter 1's `RotaryEmbedding` bit for bit, fp32 and bf16, with fp32 or bf16 tables, plain and
  llama3-scaled frequencies; it refuses a position outside the tables, a float16 tensor and a q of the wrong
  shape, each with an error naming it, before anything is written.
- **`use_cpu_ops`** puts a CPURMSNorm / CPURotaryEmbedding holding the very same Parameters and tables in place
  of each plain module; a model with nothing on a CPU in fp32/bf16 compiles nothing; a tensor the kernels do not
  take goes to chapter 1's forward.
- **The engine**: `LLM()` (cpu_ops="auto") gives transformers' greedy tokens on every test architecture, as
  `LLM(cpu_ops="off")` does; a bad setting is refused; where the operations do not build, the engine keeps
  chapter 1's modules.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.entrypoints import llm as entrypoint
from minivllm.kernels.cpu_ops import load_cpu_ops
from minivllm.model import cpu_layers
from minivllm.model.cpu_layers import CPURMSNorm, CPURotaryEmbedding, use_cpu_ops
from minivllm.kernels.build import KernelUnavailable
from minivllm.model.layers import RMSNorm, RotaryEmbedding
from tests.conftest import kernel_or_skip


def built():
    return kernel_or_skip(load_cpu_ops)


def tables(rope_scaling=None) -> RotaryEmbedding:
    """Rotary tables for head_dim 64 and 512 positions (chapter 1's module reads only these fields)."""
    return RotaryEmbedding(SimpleNamespace(head_dim=64, rope_theta=500000.0, rope_scaling=rope_scaling,
                                           max_model_len=512))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 2 ** -20), (torch.bfloat16, 2 ** -8)])
@pytest.mark.parametrize("shape", [(1, 576), (33, 64), (5, 8, 16), (3, 48)])
def test_rms_norm_matches_chapter_1s_norm(dtype, bound, shape):
    ops, gen = built(), torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1], generator=gen)
    norm = norm.to(dtype)
    x = (4 * torch.randn(*shape, generator=gen)).to(dtype)
    with torch.no_grad():
        want, got = norm(x).float(), ops.rms_norm(x, norm.weight, norm.eps)
    assert got.shape == x.shape and got.dtype == dtype
    assert float((got.float() - want).abs().max()) <= bound * float(want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rotary_equals_chapter_1s_rotation_bit_for_bit(dtype, table_dtype, scaling):
    ops, gen = built(), torch.Generator().manual_seed(1)
    rope = tables(scaling).to(table_dtype)
    q, k = torch.randn(6, 8, 64, generator=gen).to(dtype), torch.randn(6, 2, 64, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 63, 64, 300, 511])
    want_q, want_k = rope(positions, q.clone(), k.clone())
    ops.rotary_(positions, q, k, rope.cos, rope.sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rotary_refuses_what_it_cannot_rotate_before_writing_anything():
    ops, rope = built(), tables()
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    before = q.clone(), k.clone()
    cases = [((torch.tensor([0, 512]), q, k), "position 512 is outside the tables"),
             ((torch.tensor([0, 1]), q.half(), k.half()), "float32 or bfloat16 only"),
             ((torch.tensor([0, 1]), q[:, :, :32].contiguous(), k), r"\[tokens, heads, head_dim\]"),
             ((torch.tensor([0, 1], dtype=torch.int32), q, k), "positions must be int64")]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.rotary_(*args, rope.cos, rope.sin)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


class Block(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.norm, self.inner = RMSNorm(16, 1e-5).to(dtype), nn.ModuleList([RMSNorm(8, 1e-5).to(dtype)])
        self.rope = tables().to(dtype)


def test_use_cpu_ops_swaps_in_place_holding_the_same_parameters_and_tables():
    built()
    model = Block(torch.float32)
    weights, cos = [model.norm.weight, model.inner[0].weight], model.rope.cos
    assert use_cpu_ops(model) == 3
    assert [type(m) for m in (model.norm, model.inner[0], model.rope)] == [CPURMSNorm, CPURMSNorm, CPURotaryEmbedding]
    assert model.norm.weight is weights[0] and model.inner[0].weight is weights[1] and model.rope.cos is cos
    assert [n for n, _ in model.named_parameters()] == ["norm.weight", "inner.0.weight"]
    x = torch.randn(3, 16)
    assert torch.allclose(model.norm(x), RMSNorm.forward(model.norm, x), rtol=1e-6, atol=1e-6)
    q, k = torch.randn(2, 8, 64).transpose(0, 1)[:2], torch.randn(2, 1, 64)  # q not contiguous: chapter 1's path
    assert not q.is_contiguous()
    want = RotaryEmbedding.forward(model.rope, torch.tensor([3, 4]), q, k)
    got = model.rope(torch.tensor([3, 4]), q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_model_without_cpu_fp32_or_bf16_modules_compiles_nothing(monkeypatch):
    def no_build():
        raise AssertionError("the operations were built for a float16 model")

    monkeypatch.setattr(cpu_layers, "load_cpu_ops", no_build)
    model = Block(torch.float16)
    assert use_cpu_ops(model) == 0 and type(model.norm) is RMSNorm


@pytest.mark.parametrize("family", ["qwen3-gqa2-tied", "qwen3-headdim-differs-untied", "qwen2-qkv-bias-gqa4"])
def test_the_engine_with_cpu_ops_gives_transformers_greedy_tokens(checkpoints, family):
    built()
    folder, hf = checkpoints[family]
    prompts = [[5, 9, 11, 3, 200, 17], [7] * 19, list(range(3, 40))]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for setting in ("auto", "off"):
        llm = LLM(str(folder), cpu_ops=setting, max_num_batched_tokens=16)
        swapped = sum(isinstance(m, (CPURMSNorm, CPURotaryEmbedding)) for m in llm.engine.model.modules())
        assert (swapped > 0) == (setting == "auto")
        runs[setting] = [o.outputs[0].token_ids for o in
                         llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    for prompt, got, off in zip(prompts, runs["auto"], runs["off"]):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want == off


def test_the_default_engine_swaps_and_a_bad_setting_is_refused(monkeypatch):
    built()
    modules = list(LLM().engine.model.modules())
    assert any(type(m) is CPURMSNorm for m in modules) and any(type(m) is CPURotaryEmbedding for m in modules)
    assert not any(type(m) in (RMSNorm, RotaryEmbedding) for m in modules)
    with pytest.raises(ValueError, match="cpu_ops = 'on'"):
        LLM(cpu_ops="on")
    def no_compiler():
        raise KernelUnavailable("no C++ compiler: 'c++' is not on PATH")

    monkeypatch.setattr(entrypoint, "load_cpu_ops", no_compiler)  # no compiler: chapter 1's modules stay
    assert not any(isinstance(m, (CPURMSNorm, CPURotaryEmbedding)) for m in LLM().engine.model.modules())
