"""Chapter 8b's GEMV (`minivllm/kernels/cpu_gemv.py`): the product of `nn.Linear` for 1 to 4 rows, bf16 or fp32.

- **The product.** Against a float64 product of the same bf16 numbers, at shapes that break an unrolled loop (one
  output row, fewer than four, a count that is not a multiple of four, one line of 32 weights, three lines,
  SmolLM2's 576 and 1,536), for 1 to 4 activation rows: the GEMV's largest error, relative to the largest
  output, is at most 1.5 times the one `torch.nn.functional.linear` makes in bf16 on the same inputs (both sum
  in fp32 and round once to bf16; they differ in the order of the additions). Checked for the AVX-512 BF16 loop
  where this CPU has it, for AVX2's FMA loop on widened bf16 where it has AVX2 FMA (built for the `avx2` level),
  and for the portable loop everywhere (built for the `portable` level: no vector instructions asked for).
- **fp32**: the FMA loop where this CPU has AVX2 FMA, and the portable loop everywhere, at
  widths that leave 8, 24 or none of a row after its turns of 32 weights: the largest error relative to the
  largest output within 2^-20, as torch's own fp32 linear is.
- **Its refusals**: other dtypes, more than four rows, K not a multiple of 32 (bf16) or 8 (fp32), each with an
  error naming it.
- **`use_gemv`**: a model with no bf16 or fp32 layer is left as it is and nothing is compiled; otherwise each
  plain `nn.Linear` whose dtype the GEMV is selectable for (with everywhere=True, every bf16 and fp32 one) is
  replaced, in its parent, by a `GemvLinear` holding the same Parameter objects (no copy; a tied output layer
  stays tied), and `cpu_gemv="auto"` does it exactly where `gemv_selectable(dtype)` says so, for bf16 and fp32.
- **An fp32 engine with `cpu_gemv="on"`** gives transformers' greedy tokens on the book's prompts, every product
  of at most 4 rows in the fp32 GEMV.
- **The engine**: the GEMV sums in another order than torch's matmul, so its bf16 tokens can part from torch's at
  a near-tie (the test prints where they do). They are held to tests/test_bf16.py's definition of a correct bf16
  engine: greedy tokens equal fp32 transformers' up to the first step where fp32's two best logits are within
  2 * LOGIT_BOUND of each other, and the first divergence, if any, is at such a step. The engine runs with at most
  4 rows per step, so every product of the model, prefill chunks included, goes through the GEMV.
"""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.kernels import cpu_gemv
from minivllm.kernels.build import ISA_LEVELS, KernelUnavailable, isa_level
from minivllm.kernels.cpu_gemv import GEMV_MAX_ROWS, GemvLinear, gemv_selectable, load_cpu_gemv, use_gemv
from minivllm.model.loader import DEFAULT_MODEL
from tests.conftest import kernel_missing, kernel_or_skip
from tests.test_bf16 import BOOK_TEXTS, GREEDY_TOKENS, LOGIT_BOUND, first_divergence, greedy_with_margins

PORTABLE = "portable"


def built(isa=None):
    """The GEMV module built for `isa` (default: this CPU's level), or a skip where it cannot be built here (no
    compiler, kernels turned off, or a level above this CPU's)."""
    if isa is not None and ISA_LEVELS.index(isa) > ISA_LEVELS.index(isa_level()):
        pytest.skip(f"this CPU (or MINIVLLM_CPU_ISA) stops below {isa}")
    return kernel_or_skip(load_cpu_gemv, isa)


def has_dpbf16() -> bool:
    return not kernel_missing(load_cpu_gemv) and bool(load_cpu_gemv().has_dpbf16())


needs_dpbf16 = pytest.mark.skipif(not has_dpbf16(), reason="this CPU has no AVX-512 BF16 (its FMA and portable "
                                                           "loops are still tested)")


@pytest.fixture(params=["avx512bf16", "fma", "portable"])
def gemv(request):
    if request.param == "avx512bf16":
        module = built()
        if not module.has_dpbf16():
            pytest.skip("this CPU has no AVX-512 BF16")
    elif request.param == "fma":  # the AVX2 loop on widened bf16, which bf16 takes without AVX-512 BF16
        module = built("avx2")
        if not module.has_fma():
            pytest.skip("this CPU has no AVX2 FMA")
        assert not module.has_dpbf16()
    else:
        module = built(PORTABLE)
        assert not module.has_dpbf16() and not module.has_fma()
    return module


@pytest.fixture(params=["fma", "portable"])
def gemv_f32(request):
    module = built() if request.param == "fma" else built(PORTABLE)
    if request.param == "fma" and not module.has_fma():
        pytest.skip("this CPU has no AVX2 FMA")
    assert module.has_fma() == (request.param == "fma")
    return module


@pytest.mark.parametrize("n", [1, 3, 5, 577])
@pytest.mark.parametrize("k", [8, 40, 56, 576, 1536])  # 32 weights a turn: 8 and 24 left, and none
def test_the_fp32_gemv_is_as_accurate_as_torchs_fp32_linear(gemv_f32, n, k):
    gen = torch.Generator().manual_seed(n * 10_000 + k)
    for m in range(1, GEMV_MAX_ROWS + 1):
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
        exact = x.double() @ w.double().T
        got = gemv_f32.gemv_f32(x, w)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        for product in (got, torch.nn.functional.linear(x, w)):
            assert (product.double() - exact).abs().max() <= 2 ** -20 * exact.abs().max(), (m, n, k)
    x = torch.randn(32, 3, generator=gen).T  # strided operands read as their values
    w = torch.randn(32, 16, generator=gen).T
    assert torch.equal(gemv_f32.gemv_f32(x, w), gemv_f32.gemv_f32(x.contiguous(), w.contiguous()))


@pytest.mark.parametrize("n", [1, 3, 5, 577])
@pytest.mark.parametrize("k", [32, 96, 576, 1536])  # lines of 32 into two sums in turn: an odd count, and even
def test_gemv_is_as_accurate_as_torchs_bf16_linear(gemv, n, k):
    gen = torch.Generator().manual_seed(n * 10_000 + k)
    for m in range(1, GEMV_MAX_ROWS + 1):
        x = torch.randn(m, k, generator=gen).bfloat16()
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
        exact = x.double() @ w.double().T
        got = gemv.gemv_bf16(x, w)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        ours = (got.double() - exact).abs().max().item()
        torchs = (torch.nn.functional.linear(x, w).double() - exact).abs().max().item()
        assert ours <= 1.5 * torchs, (m, n, k, ours, torchs)


def test_gemv_reads_strided_activations_and_weights_as_their_values(gemv):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, generator=gen).bfloat16().T  # [3, 64], not contiguous
    w = torch.randn(64, 16, generator=gen).bfloat16().T  # [16, 64], not contiguous either
    assert torch.equal(gemv.gemv_bf16(x, w), gemv.gemv_bf16(x.contiguous(), w.contiguous()))


@pytest.mark.parametrize("x_shape, w_shape, dtype, message", [
    ((1, 64), (8, 64), torch.float32, "must be bfloat16"),
    ((5, 64), (8, 64), torch.bfloat16, "1 to 4 rows, not 5"),
    ((2, 48), (8, 48), torch.bfloat16, "K must be a multiple of 32, not 48"),
    ((2, 64), (8, 32), torch.bfloat16, r"x must be \[M, K\] and w \[N, K\]"),
    ((1, 64), (8, 64), torch.bfloat16, "gemv_f32: x and w must be float32"),
    ((5, 64), (8, 64), torch.float32, "gemv_f32: x must have 1 to 4 rows, not 5"),
    ((2, 12), (8, 12), torch.float32, "gemv_f32: K must be a multiple of 8, not 12"),
])
def test_gemv_refuses_what_it_cannot_compute(x_shape, w_shape, dtype, message):
    gemv = built(PORTABLE)  # the checks are the same code in both builds
    product = gemv.gemv_f32 if message.startswith("gemv_f32") else gemv.gemv_bf16
    with pytest.raises(RuntimeError, match=message):
        product(torch.zeros(x_shape, dtype=dtype), torch.zeros(w_shape, dtype=dtype))


class Tiny(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.embed = nn.Embedding(10, 64, dtype=dtype)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 96, dtype=dtype), nn.Linear(96, 64, bias=False,
                                                                                          dtype=dtype))])
        self.odd = nn.Linear(48, 64, dtype=dtype)  # K not a multiple of 32: stays an nn.Linear
        self.head = nn.Linear(64, 10, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight  # tied, as a small model's output layer


def test_use_gemv_leaves_a_float16_model_alone_and_compiles_nothing(monkeypatch):
    def no_build(*args):
        raise AssertionError("the GEMV was built for a float16 model")

    monkeypatch.setattr(cpu_gemv, "load_cpu_gemv", no_build)
    monkeypatch.setattr(cpu_gemv, "gemv_selectable", no_build)
    model = Tiny(torch.float16)
    before = dict(model.named_modules())
    assert use_gemv(model) == 0 and use_gemv(model, everywhere=True) == 0
    assert dict(model.named_modules()) == before


def test_use_gemv_keeps_torchs_matmul_where_the_dtype_has_no_vector_loop(monkeypatch):
    built()
    monkeypatch.setattr(cpu_gemv, "gemv_selectable", lambda dtype: dtype == torch.bfloat16)
    assert use_gemv(Tiny(torch.float32)) == 0
    assert use_gemv(Tiny(torch.bfloat16)) == 3
    monkeypatch.setattr(cpu_gemv, "gemv_selectable", lambda dtype: dtype == torch.float32)
    assert use_gemv(Tiny(torch.float32)) == 4 and use_gemv(Tiny(torch.bfloat16)) == 0


def test_gemv_selectable_is_false_where_the_gemv_does_not_build(monkeypatch):
    def no_compiler(*args):
        raise KernelUnavailable("no C++ compiler: 'c++' is not on PATH")

    monkeypatch.setattr(cpu_gemv, "load_cpu_gemv", no_compiler)
    assert not gemv_selectable(torch.float32) and not gemv_selectable(torch.bfloat16)
    assert use_gemv(Tiny(torch.float32)) == 0


def test_everywhere_puts_fp32_layers_in_the_fp32_gemv():
    built()
    model = Tiny(torch.float32)
    assert use_gemv(model, everywhere=True) == 4  # blocks.0.0, blocks.0.1, odd (48 = 6 x 8) and head
    assert model.head.weight is model.embed.weight
    layer, x = model.odd, torch.randn(2, 48)
    assert type(layer) is GemvLinear and torch.equal(layer(x), load_cpu_gemv().gemv_f32(x, layer.weight) + layer.bias)


def test_use_gemv_puts_gemv_layers_in_place_holding_the_same_parameters():
    built()
    model = Tiny(torch.bfloat16)
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    assert use_gemv(model, everywhere=True) == 3  # blocks.0.0, blocks.0.1, head; not odd
    assert [type(model.get_submodule(n)) for n in ("blocks.0.0", "blocks.0.1", "head", "odd")] == [
        GemvLinear, GemvLinear, GemvLinear, nn.Linear]
    assert {name: p for name, p in model.named_parameters(remove_duplicate=False)}.keys() == params.keys()
    for name, p in model.named_parameters(remove_duplicate=False):
        assert p is params[name], name  # the very Parameter objects: nothing copied, nothing reallocated
    assert model.head.weight is model.embed.weight and model.blocks[0][1].bias is None
    assert not any(p.is_meta for p in model.parameters())
    layer, x = model.blocks[0][0], torch.randn(3, 64).bfloat16()
    assert torch.equal(layer(x), load_cpu_gemv().gemv_bf16(x, layer.weight) + layer.bias)
    x = torch.randn(GEMV_MAX_ROWS + 1, 64).bfloat16()  # more rows: torch's matmul, as nn.Linear
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_auto_takes_the_gemv_exactly_where_it_is_selectable(dtype):
    built()
    llm = LLM(dtype=dtype)
    gemv_layers = sum(isinstance(m, GemvLinear) for m in llm.engine.model.modules())
    plain = sum(type(m) is nn.Linear for m in llm.engine.model.modules())
    selectable = gemv_selectable(getattr(torch, dtype))
    assert (gemv_layers > 0 and plain == 0) if selectable else (gemv_layers == 0 and plain > 0)
    off = LLM(dtype=dtype, cpu_gemv="off")
    assert not any(isinstance(m, GemvLinear) for m in off.engine.model.modules())
    with pytest.raises(ValueError, match="cpu_gemv = 'yes'"):
        LLM(dtype="bfloat16", cpu_gemv="yes")


@needs_dpbf16
def test_auto_selects_the_avx512_bf16_loop():
    assert load_cpu_gemv().has_dpbf16()
    assert use_gemv(Tiny(torch.bfloat16)) == 3


def counting_gemv(calls: list) -> object:
    """The GEMV module, with each product's row count appended to `calls` (to patch in as load_cpu_gemv())."""
    module = load_cpu_gemv()

    class Counting:
        @staticmethod
        def gemv_bf16(x, w):
            calls.append(x.shape[0])
            return module.gemv_bf16(x, w)

        @staticmethod
        def gemv_f32(x, w):
            calls.append(x.shape[0])
            return module.gemv_f32(x, w)

    return Counting


@pytest.fixture(scope="module")
def gemv_greedy_runs():
    """For each book prompt: the GEMV engine's bf16 tokens, torch's matmul's, fp32 transformers', fp32's top-two gaps
    and the near-tie threshold; and how many products of at most 4 rows the GEMV computed."""
    built()
    calls = []
    Counting = counting_gemv(calls)
    runs, limits = {}, dict(max_num_seqs=GEMV_MAX_ROWS, max_num_batched_tokens=GEMV_MAX_ROWS)
    for setting in ("on", "off"):  # at most 4 rows a step: prefill chunks and decode steps all fit the GEMV
        llm = LLM(dtype="bfloat16", cpu_gemv=setting, **limits)
        prompts = [llm.tokenizer(t).input_ids[:64] for t in BOOK_TEXTS]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu_gemv, "load_cpu_gemv", lambda: Counting)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True),
                                   use_tqdm=False)
        runs[setting] = [o.outputs[0].token_ids for o in outputs]
        if setting == "on":
            gemv_calls, calls[:] = len(calls), []
    assert not calls  # "off" never reaches the GEMV
    hf32 = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    table = []
    for prompt, got, onednn in zip(prompts, runs["on"], runs["off"]):
        want, margins, scale = greedy_with_margins(hf32, prompt, GREEDY_TOKENS)
        table.append((got, onednn, want, margins, 2 * LOGIT_BOUND * scale))
    return table, gemv_calls


def test_the_gemv_engine_is_a_correct_bf16_engine(gemv_greedy_runs, capsys):
    table, gemv_calls = gemv_greedy_runs
    assert gemv_calls > 0
    lines = []
    for i, (got, onednn, want, margins, tie) in enumerate(table):
        diverged, parted = first_divergence(got, want), first_divergence(got, onednn)
        lines.append(f"prompt {i}: GEMV engine's first divergence from fp32 transformers at token "
                     f"{'none' if diverged is None else diverged} of {GREEDY_TOKENS}"
                     + ("" if diverged is None else f" (fp32's top-two gap there {margins[diverged]:.3f}, "
                                                     f"near-tie threshold {tie:.3f})")
                     + f"; from bf16 with torch's products at {'none' if parted is None else parted}")
        if diverged is not None:
            assert margins[diverged] < tie, lines[-1]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_an_fp32_engine_on_the_fp32_gemv_gives_transformers_tokens():
    built()
    calls = []
    Counting = counting_gemv(calls)
    llm = LLM(cpu_gemv="on", max_num_seqs=GEMV_MAX_ROWS, max_num_batched_tokens=GEMV_MAX_ROWS)
    prompts = [llm.tokenizer(t).input_ids[:64] for t in BOOK_TEXTS]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_gemv, "load_cpu_gemv", lambda: Counting)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True), use_tqdm=False)
    assert len(calls) > 100
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                               do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == want
