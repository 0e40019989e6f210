"""The bfloat16 path (`LLM(dtype="bfloat16")`): weights and KV cache in bf16, matmuls through oneDNN (products of at
most 4 rows through chapter 8b's GEMV where it is selected: tests/test_cpu_gemv.py holds that engine to the same
definition), the C++ decode kernel reading bf16 keys and values and summing in fp32.

bf16 cannot be token-identical to fp32, so its correctness is defined by three bounds, each checked here:

1. **The kernel rounds only its output.** It widens every key and value to fp32 as it loads it and sums in fp32,
   so against the fp32 reference on the same (bf16-representable) inputs it differs by the final rounding to bf16,
   half a unit in the last place (2^-9 relative), plus fp32 summation order: asserted within 2^-8 * |reference|.
2. **Logits.** (a) Against transformers run in bf16 on the same checkpoint and tokens, ours are no further from
   fp32 than transformers' own bf16 logits are (the largest error over every position within 1.5x of
   transformers'): the same precision, not a worse implementation (measured here: within 3% of it).
   (b) Against fp32, every logit within LOGIT_BOUND = 2^-6 of the largest logit's magnitude: bf16 keeps 8
   significant bits (2^-9 relative rounding), and the roundings of a few layers in sequence compound to a few
   times that (measured: at most 0.0082 of it on the embedded model, 0.006 on the random-init ones).
3. **Greedy tokens.** On the book's prompts, bf16 greedy decoding through the whole engine (paged cache,
   chunked prefill, the kernel) equals fp32 transformers' greedy tokens up to the first step where fp32's top two
   logits are within 2 * LOGIT_BOUND of each other (a near-tie that an error within the bound can flip), and the
   first divergence, if any, is at such a step. The test prints each prompt's first divergence (run with -s).
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from minivllm.attention.base import NoCacheAttention
from minivllm.attention.cpu_backend import CPUPagedAttention
from minivllm.attention.paged import PagedAttention
from minivllm.book.texts import CORPUS
from minivllm.config import ModelConfig
from minivllm.kernels.cpu_attention import load_cpu_attention, paged_decode_cpu
from minivllm.model.loader import DEFAULT_MODEL, load_model, load_weights
from tests.conftest import kernel_missing
from tests.test_cpu_attention import paged_step

pytestmark = pytest.mark.skipif(kernel_missing(load_cpu_attention), reason="no C++ compiler here, or the kernels are off")

LOGIT_BOUND = 2 ** -6  # of the largest logit's magnitude
GREEDY_TOKENS = 32
# the book's prompts: chapter 8b's three texts and chapter 6's workload (slices of the corpus, cut to 64 tokens)
BOOK_TEXTS = ["ROMEO:\n", "First Citizen:\nWe are accounted poor citizens, the patricians good.\n",
              "To be, or not to be"] + [CORPUS[i * 60:i * 60 + 1000] for i in range(5)]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (9, 3, 64), (4, 4, 16)])
def test_bf16_decode_kernel_rounds_only_its_output(block_size, heads, kv_heads, head_dim):
    lengths = [1, block_size, block_size + 1, 5 * block_size + 3, 300]
    args, q, k, v = paged_step([n - 1 for n in lengths], [1] * len(lengths), block_size, heads, kv_heads, head_dim,
                               dtype=torch.bfloat16, seed=block_size)
    cache, _, _, seq_lens, tables = args
    PagedAttention(*args).write_kv(0, k, v)
    got = paged_decode_cpu(q, *cache.layer(0), tables, seq_lens)
    assert got.dtype == torch.bfloat16
    k_cache, v_cache = (c.float() for c in cache.layer(0))
    expected = PagedAttention._decode(q.float(), k_cache, v_cache, tables, seq_lens)
    error = (got.float() - expected).abs()
    assert (error <= 2 ** -8 * expected.abs() + 1e-6).all(), error.max()


def test_the_bf16_engine_keeps_weights_and_cache_in_bf16_and_decodes_on_the_kernel():
    llm, fp32 = LLM(dtype="bfloat16"), LLM()
    runner = llm.engine.model_runner
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert runner.kv_cache.kv.dtype == torch.bfloat16 and runner.backend is CPUPagedAttention
    assert 2 * runner.kv_cache.bytes_per_block == fp32.engine.model_runner.kv_cache.bytes_per_block
    calls = []
    runner.backend = type("Counting", (CPUPagedAttention,), {
        "decode": staticmethod(lambda *a: calls.append(a[1].dtype) or paged_decode_cpu(*a))})
    llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert calls and set(calls) == {torch.bfloat16}


def logits_of(model, ids: list[int]) -> torch.Tensor:
    return model.compute_logits(model(*NoCacheAttention.for_sequences([ids]))).float()


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def checkpoint_cases(checkpoints):
    """(folder, token-id prompts) for the embedded model and three random-init families."""
    tokenizer = load_model()[1]
    yield DEFAULT_MODEL, [tokenizer(t).input_ids[:64] for t in BOOK_TEXTS]
    gen = torch.Generator().manual_seed(3)
    for family in ("qwen3-gqa2-tied", "qwen2-qkv-bias-gqa4", "llama-biases-llama3-rope"):
        yield checkpoints[family][0], [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 40, 90)]


def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16_and_within_the_bound(checkpoints):
    for folder, prompts in checkpoint_cases(checkpoints):
        config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        ours = load_weights(folder, config, torch.bfloat16, torch.device("cpu"))
        hf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ours_error = hf_error = scale = 0.0
        for ids in prompts:
            reference = hf_logits(hf32, ids)
            ours_error = max(ours_error, (logits_of(ours, ids) - reference).abs().max().item())
            hf_error = max(hf_error, (hf_logits(hf16, ids) - reference).abs().max().item())
            scale = max(scale, reference.abs().max().item())
        assert ours_error <= 1.5 * hf_error, (folder.name, ours_error, hf_error)
        assert ours_error <= LOGIT_BOUND * scale, (folder.name, ours_error, scale)


def greedy_with_margins(hf_model, ids: list[int], n: int) -> tuple[list[int], list[float], float]:
    """fp32 transformers' greedy tokens, the gap between its two best logits at each step, its largest logit."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    top2 = [step[0].float().topk(2).values for step in out.logits]
    return out.sequences[0, len(ids):].tolist(), [(a - b).item() for a, b in top2], max(
        step[0].abs().max().item() for step in out.logits)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.fixture(scope="module")
def greedy_runs():
    return book_greedy_runs(LLM(dtype="bfloat16", max_num_batched_tokens=16))  # prompts in chunks: every path


def book_greedy_runs(llm):
    """For each book prompt: `llm`'s greedy tokens, fp32 transformers tokens, fp32 margins, the tie threshold."""
    hf32 = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    prompts = [llm.tokenizer(t).input_ids[:64] for t in BOOK_TEXTS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True), use_tqdm=False)
    runs = []
    for prompt, output in zip(prompts, outputs):
        want, margins, scale = greedy_with_margins(hf32, prompt, GREEDY_TOKENS)
        runs.append((output.outputs[0].token_ids, want, margins, 2 * LOGIT_BOUND * scale))
    return runs


def test_bf16_greedy_follows_fp32_transformers_up_to_a_near_tie(greedy_runs, capsys):
    assert_greedy_follows_fp32_up_to_a_near_tie(greedy_runs, capsys)


def assert_greedy_follows_fp32_up_to_a_near_tie(runs, capsys):
    """runs: for each prompt, (engine tokens, fp32 transformers tokens, fp32 margins, near-tie threshold). Prints
    each prompt's first divergence; one that is not at a near-tie fails."""
    lines = []
    for i, (got, want, margins, tie) in enumerate(runs):
        diverged = first_divergence(got, want)  # after it the two continue from different texts
        lines.append(f"prompt {i}: first divergence from fp32 transformers at token "
                     f"{'none' if diverged is None else diverged} of {GREEDY_TOKENS}"
                     + ("" if diverged is None else f" (fp32's top-two gap there {margins[diverged]:.3f}, "
                                                     f"near-tie threshold {tie:.3f})"))
        if diverged is not None:
            assert margins[diverged] < tie, lines[-1]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
