"""The redesign's promises: the layout's import rule, no side effects on import, requests of one step sharing
their prompt through the prefix cache, batched sampling, incremental detokenization, and a failed step that
fails only its own requests."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.book.texts import CORPUS
from minivllm.core.request import Request
from minivllm.core.stop_checker import IncrementalDetokenizer, StopChecker
from minivllm.engine.llm_engine import EngineStepError
from minivllm.engine.sampler import Sampler, sample_token, sampling_probs
from minivllm.model.loader import DEFAULT_MODEL
from minivllm.tools.notebooks import book_notebooks

PACKAGE = Path(minivllm.__file__).parent
NOTEBOOKS = PACKAGE.parent / "notebooks"
NOT_ENGINE = ("minivllm.book", "minivllm.tools", "minivllm.exercises", "minivllm.cli", "minivllm.__main__")


def module_imports() -> dict[str, set[str]]:
    """Every module of the package -> the minivllm modules it imports (anywhere in its code)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minivllm"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("minivllm"))
        graph[name] = found
    return graph


def test_the_engine_never_imports_the_book_or_the_tools():
    graph = module_imports()
    engine = [m for m in graph if not m.startswith(NOT_ENGINE)]
    assert "minivllm.core.scheduler" in engine and "minivllm.entrypoints.llm" in engine
    offenders = {m: sorted(i for i in graph[m] if i.startswith(NOT_ENGINE)) for m in engine}
    assert {m: i for m, i in offenders.items() if i} == {}


def test_no_class_is_made_at_run_time_and_none_is_deeper_than_two_of_ours():
    """Issue 37: one class per role, composed from parts; no class factories (type() with three arguments), no
    mixin towers: every class of the package has at most two minivllm classes among its ancestors."""
    made = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in PACKAGE.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "type" and len(node.args) == 3]
    assert made == []
    import importlib
    import inspect
    import pkgutil

    deep = []
    for info in pkgutil.walk_packages(minivllm.__path__, "minivllm."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                ours = [k.__name__ for k in cls.__mro__[1:] if k.__module__.startswith("minivllm")]
                if len(ours) > 2:
                    deep.append(f"{module.__name__}.{name}: {ours}")
    assert deep == []


def test_no_import_cycles():
    graph = module_imports()

    def resolve(name):  # `from minivllm.core import x` may name a module or a package
        return name if name in graph else name.rsplit(".", 1)[0]

    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(resolve(i) for i in graph[module]):
            if target == module or target not in graph:
                continue
            assert state.get(target) != "open", f"import cycle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_importing_the_package_changes_no_environment_variable():
    code = ("import os, json; before = dict(os.environ)\n"
            "import minivllm, minivllm.attention.selector, minivllm.spec_decode.engine, minivllm.entrypoints.openai_server\n"
            "print(json.dumps(dict(os.environ) == before))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "true"


# ------------------------------------------------------------------ same-step sharing (vLLM V1 caches at allocation)

@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, enable_prefix_caching=True, block_size=16)


def corpus_tokens(llm, start, count):
    """count tokens of the book's corpus from token `start` on (the corpus repeated as needed)."""
    tokens = llm.get_tokenizer()(CORPUS).input_ids
    return (tokens * (1 + (start + count) // len(tokens)))[start:start + count]


def test_identical_prompts_in_one_call_share_their_blocks(llm, hf_model):
    prompt = corpus_tokens(llm, 100, 200)
    assert len(prompt) == 200
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first, second = llm.generate([{"prompt_token_ids": prompt}] * 2, greedy, use_tqdm=False)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 192)  # 12 full blocks; the last token is computed
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                                     do_sample=False)[0, 200:].tolist()
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == expected
    assert llm.stats()["kv_blocks_free"] == 256


def test_the_n_samples_of_one_request_share_the_prompt(llm):
    prompt = corpus_tokens(llm, 400, 218)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=16)
    before = llm.stats()["prefix_cache_hits"]
    [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] - before >= 3 * 208
    [again] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    samples = [c.token_ids for c in out.outputs]
    assert samples == [c.token_ids for c in again.outputs] and len(set(map(tuple, samples))) > 1


# ------------------------------------------------------------------ the batched sampler

def fake_request(params, seed=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return Request("r", [1], params, StopChecker(params), generator)


def test_batched_sampler_draws_what_the_one_row_sampler_draws():
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 3
    settings = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=20),
                SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.05),
                SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01), SamplingParams(temperature=2.0)]
    for seed in range(20):
        requests = [fake_request(p, seed * 10 + i) for i, p in enumerate(settings)]
        batched = Sampler()(logits, requests, torch.Generator())
        one_by_one = [sample_token(logits[i], p, torch.Generator().manual_seed(seed * 10 + i))
                      for i, p in enumerate(settings)]
        assert batched == one_by_one


def test_batched_sampler_follows_sampling_probs():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 2
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    requests = [fake_request(params) for _ in range(4000)]
    tokens = Sampler()(logits.expand(4000, -1).contiguous(), requests, torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor(tokens), minlength=50).float() / 4000
    probs = sampling_probs(logits, params)
    probs = probs / probs.sum()
    assert torch.all(counts[probs == 0] == 0) and (counts - probs).abs().max() < 0.03


# ------------------------------------------------------------------ incremental detokenization

def test_incremental_text_equals_the_full_decode_on_long_outputs(llm):
    tokenizer = llm.get_tokenizer()
    gen = torch.Generator().manual_seed(3)
    cases = [corpus_tokens(llm, 0, 600), torch.randint(0, tokenizer.vocab_size, (600,), generator=gen).tolist()]
    text = "naïve café, 東京 — ✓ 🎉 " * 20  # characters split over several byte-level tokens
    cases.append(tokenizer(text).input_ids)
    for tokens in cases:
        detokenizer = IncrementalDetokenizer(tokenizer)
        for n in range(1, len(tokens) + 1):
            detokenizer.update(tokens[:n])
            full = tokenizer.decode(tokens[:n], skip_special_tokens=True)
            assert full.startswith(detokenizer.text) and detokenizer.full_text(tokens[:n]) == full
        assert detokenizer.prefix_offset > len(tokens) - 20  # it decoded only a short tail each time


def test_stop_strings_found_incrementally_match_a_full_search(llm):
    tokenizer = llm.get_tokenizer()
    tokens = corpus_tokens(llm, 300, 300)
    full = tokenizer.decode(tokens)
    assert len(full) > 800
    for stop in ["\n\n", "the ", "KING", full[700:712], "zzz-never"]:
        for include in (False, True):
            params = SamplingParams(stop=[stop, "@@@"], include_stop_str_in_output=include, max_tokens=None)
            checker = StopChecker(params, tokenizer)
            reason, n = None, 0
            while reason is None and n < len(tokens):
                n += 1
                reason = checker.finish_reason(tokens[:n])
            at = full.find(stop)
            if at < 0:
                assert reason is None and checker.text(tokens) == full
            else:
                assert reason == "stop" and checker.text(tokens[:n]) == full[:at + (len(stop) if include else 0)]


# ------------------------------------------------------------------ a failing step fails only its own requests

def test_a_failed_forward_pass_aborts_its_requests_and_the_engine_serves_on(monkeypatch):
    llm = LLM(num_kv_blocks=64)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = llm.generate(["ROMEO:"] * 2, greedy, use_tqdm=False)
    real = engine.model_runner.execute
    calls = {"n": 0}

    def flaky(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real(scheduler_output)

    monkeypatch.setattr(engine.model_runner, "execute", flaky)
    with pytest.raises(EngineStepError, match="injected failure") as failure:
        llm.generate(["JULIET:", "HAMLET:"], greedy, use_tqdm=False)
    assert len(failure.value.request_ids) == 2  # the step ran both: both were aborted
    assert not engine.has_unfinished_requests() and engine.kv_manager.pool.num_free == 64
    assert not engine.kv_manager.pool.cached  # nothing half-written stays findable
    assert not engine.output_processor.parents  # generate took back what it added
    monkeypatch.setattr(engine.model_runner, "execute", real)
    again = llm.generate(["ROMEO:"] * 2, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_a_huge_temperature_is_a_float_and_a_bad_salt_is_refused_up_front():
    llm = LLM(num_kv_blocks=64)
    assert SamplingParams(temperature=2**64).temperature == float(2**64)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=2**2000)
    outs = llm.generate(["ROMEO:", "JULIET:"], [SamplingParams(temperature=0, max_tokens=4),
                                              SamplingParams(temperature=2**64, max_tokens=4, seed=0)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    with pytest.raises(ValueError, match="cache_salt"):
        llm.engine.add_request("salted", [5, 6, 7], SamplingParams(), cache_salt={1, 2})
    assert not llm.engine.has_unfinished_requests() and "salted" not in llm.engine.output_processor.parents


def test_a_failed_step_fails_only_the_requests_it_ran(monkeypatch):
    llm = LLM(num_kv_blocks=64, max_num_seqs=1)  # one request at a time: the second waits while the first fails
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [expected] = llm.generate(["HAMLET:"], greedy, use_tqdm=False)
    engine.add_request("a", tokenizer("ROMEO:").input_ids, greedy)
    engine.add_request("b", tokenizer("HAMLET:").input_ids, greedy)
    real = engine.model_runner.execute

    def fail_once(scheduler_output):
        monkeypatch.setattr(engine.model_runner, "execute", real)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.model_runner, "execute", fail_once)
    with pytest.raises(EngineStepError) as failure:
        engine.step()
    assert failure.value.request_ids == ["a"] and engine.output("a").outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.output("b").outputs[0].token_ids == expected.outputs[0].token_ids
    assert engine.kv_manager.pool.num_free == 64


def test_logprobs_are_kept_on_the_request_and_equal_transformers(llm, hf_model):
    prompt = corpus_tokens(llm, 50, 30)
    [out] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                         use_tqdm=False)
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1:-1]
    expected = logits.log_softmax(-1)
    for position, (token, (logprob, alternatives)) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert abs(logprob - expected[position, token].item()) < 1e-4
        assert [t for t, _ in alternatives] == expected[position].topk(3).indices.tolist()
        assert alternatives[0][0] == token  # greedy: the sampled token is the most likely one
    [plain] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert plain.outputs[0].logprobs is None


def test_speculative_decoding_refuses_logprobs_up_front():
    spec = LLM(num_kv_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="logprobs"):
        spec.generate("ROMEO:", SamplingParams(logprobs=1), use_tqdm=False)
    assert not spec.engine.has_unfinished_requests()


def first_definitions() -> tuple[dict[str, int], dict[tuple[str, str], int], list]:
    """From the notebooks, in book order: module -> index of the first chapter exporting it, (module, name) ->
    the first chapter defining that name in it, and every chapter's code cells as (index, notebook, tree)."""
    chapters = book_notebooks(NOTEBOOKS)
    first_module, first_name, cells = {}, {}, []
    for index, path in enumerate(chapters):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code" or not cell.source.strip():
                continue
            tree = ast.parse("\n".join(line for line in cell.source.splitlines() if not line.startswith(("%", "!"))))
            if not path.stem.startswith("00"):  # chapter 0, how to use the book, runs the finished package
                cells.append((index, path.stem, tree))
            marker = re.match(r"# export: (minivllm/[\w/]+)\.py", cell.source)
            if not marker:
                continue
            module = marker.group(1).replace("/", ".")
            first_module.setdefault(module, index)
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", node)]
                for name in [getattr(node, "name", None)] + [getattr(t, "id", None) for t in targets]:
                    if name:
                        first_name.setdefault((module, name), index)
    return first_module, first_name, cells


def test_no_chapter_imports_the_code_of_a_later_chapter():
    """A reader of chapter N never meets code from a later chapter: no cell of chapter N imports a module
    that a later chapter exports first, or a name that a later chapter adds to an earlier module. Later
    chapters plug in by rewriting a method of an earlier class in a class step (`make_kv_manager`), or through
    chapter 6's LLM_OPTIONS."""
    first_module, first_name, cells = first_definitions()
    assert first_name[("minivllm.engine.llm_engine", "LLMEngine")] < first_module["minivllm.spec_decode.engine"]
    forward = set()
    for index, notebook, tree in cells:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [(alias.name, first_module.get(alias.name, -1)) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minivllm"):
                found = [(f"{node.module}.{alias.name}", first_module.get(f"{node.module}.{alias.name}",
                          first_name.get((node.module, alias.name), first_module.get(node.module, -1))))
                         for alias in node.names]
            else:
                continue
            forward |= {f"{notebook} imports {name}" for name, chapter in found if chapter > index}
    assert sorted(forward) == []


def test_a_misspelt_keyword_and_a_switch_the_engine_cannot_build_are_refused():
    """Never ignored: a keyword no chapter defines, a tier of no size, KV events without the prefix cache whose
    names they report."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.model.loader import load_model

    with pytest.raises(TypeError, match="unexpected keyword argument 'enable_prefix_cache'"):
        LLM(enable_prefix_cache=True)  # a misspelt option
    model, _ = load_model()
    with pytest.raises(ValueError, match="kv_offloading_size = 0.0 GiB"):
        LLMEngine(model, None, EngineConfig(num_kv_blocks=8, kv_offloading_size=0.0))
    with pytest.raises(ValueError, match="enable_kv_cache_events: KV events come from the prefix cache"):
        LLMEngine(model, None, EngineConfig(num_kv_blocks=8, enable_kv_cache_events=True))
    assert not LLMEngine(model, None, EngineConfig(num_kv_blocks=8)).kv_manager.enable_caching
    assert LLMEngine(model, None, EngineConfig(num_kv_blocks=8, enable_prefix_caching=True)).kv_manager.enable_caching


def test_the_runner_keeps_its_own_block_tables_in_step_with_the_manager_and_never_reads_it():
    """The scheduler's output carries what the runner needs (issue 27): each block id is sent once, and after
    every update the runner's table of each scheduled request equals the manager's, also through
    preemptions, prefix hits and speculative decoding's reserved slots."""
    for path in ("engine/model_runner.py", "spec_decode/draft_model.py"):
        assert "kv_manager" not in (PACKAGE / path).read_text(), path
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 200 for j in range(12 + 5 * i)]} for i in range(6)]
    prompts += [prompts[0], prompts[1]]  # prefix hits
    for speculative_config in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM(num_kv_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
                  attention_backend="torch", speculative_config=speculative_config, scheduler_reserve_full_isl=False)
        engine, tables, sent, checked = llm.engine, llm.engine.model_runner.block_tables, {}, [0]
        update = tables.update

        def checking_update(new_request_ids, new_block_ids, freed_request_ids):
            update(new_request_ids, new_block_ids, freed_request_ids)
            for request_id in new_request_ids:
                sent[request_id] = []
            for request_id, block_ids in new_block_ids.items():
                sent[request_id] += block_ids
                row = tables.rows[request_id]
                assert tables.table[row, :int(tables.lengths[row])].tolist() == engine.kv_manager.block_tables[request_id]
                if speculative_config is None:  # with it, _reserve also hands the runner blocks, between steps
                    assert sent[request_id] == engine.kv_manager.block_tables[request_id]
                checked[0] += 1

        tables.update = checking_update
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        assert checked[0] > 50 and engine.scheduler.num_preemptions > 0
