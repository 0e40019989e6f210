"""Chapter 11: tensor parallelism. TP=2 greedy tokens equal TP=1 and transformers (the embedded model and
random GQA checkpoints, one with biases everywhere), also with n-gram and draft-model speculation; every rank,
the driver included, reads only its shard; bad sizes are refused before any process starts; a killed
worker fails the step with an error naming its rank, never a hang; no worker outlives its LLM."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.base import NoCacheAttention
from minivllm.engine.llm_engine import LLMEngine
from minivllm.distributed.shard import load_shard
from minivllm.engine.llm_engine import EngineStepError
from tests.conftest import save_random_checkpoint, transformers_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def worker_pids(llm) -> list[int]:
    return [p.pid for p in llm.engine.workers.processes]


def gone(pids, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(pid) for pid in pids)


def test_embedded_model_tp2_equals_tp1():
    prompts = ["ROMEO:\n", "First Citizen:\nBefore we proceed", "KING RICHARD", "O, " * 20]
    one = LLM(device="cpu", num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    two = LLM(device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        pids = worker_pids(two)
        assert len(pids) == 1 and alive(pids[0])
        assert two.engine.kv_cache.kv.shape[4] == one.engine.kv_cache.kv.shape[4] // 2  # its share of kv heads
        assert two.engine.kv_cache.num_blocks == one.engine.kv_cache.num_blocks
        got = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == expected
        again = two.generate(prompts[:2], GREEDY, use_tqdm=False)  # prefix-cache hits on both ranks
        assert [o.outputs[0].token_ids for o in again] == expected[:2] and again[0].num_cached_tokens >= 0
    finally:
        two.shutdown()
    assert gone(pids), "a worker outlived shutdown()"
    two.shutdown()  # twice is fine


def test_random_checkpoint_tp2_matches_transformers(tmp_path):
    """A random Llama with GQA (4 heads, 2 kv heads: one kv head per rank) and q/k/v/o and MLP biases, so the
    row-parallel bias must be added once, after the all-reduce (the embedded model covers Qwen3's q/k norms).
    Tokens and their log-probabilities."""
    hf_model = save_random_checkpoint(tmp_path, "llama-biases-llama3-rope")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (7, 30, 19)]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    llm = LLM(str(tmp_path), device="cpu", num_kv_blocks=32, block_size=8, tensor_parallel_size=2)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        tokens = list(output.outputs[0].token_ids)
        assert tokens == transformers_greedy(hf_model, prompt, 16)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        expected = logits[torch.arange(len(tokens)), tokens]
        got = torch.tensor([entry[0] for entry in output.outputs[0].logprobs])
        assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("size, words", [(3, "does not divide the model's num_heads = 8"), (0, "must be >= 1"),
                                         (-2, "must be >= 1"), (2.0, "must be an integer"), ("2", "must be an integer"),
                                         (True, "must be an integer"), (16, "does not divide")])
def test_bad_sizes_are_refused_before_any_process_starts(monkeypatch, size, words):
    started = []
    monkeypatch.setattr("minivllm.engine.llm_engine.TensorParallelWorkers.__init__",
                        lambda *a, **k: started.append(1) or (_ for _ in ()).throw(AssertionError("started")))
    with pytest.raises(ValueError, match="tensor_parallel_size") as error:
        LLM(device="cpu", num_kv_blocks=16, tensor_parallel_size=size)
    assert words in str(error.value) and not started


@pytest.mark.parametrize("speculative_config", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    {"method": "draft_model", "num_speculative_tokens": 3}], ids=["ngram", "draft_model"])
def test_tp2_composes_with_speculative_decoding(speculative_config):
    """Issue 27: chapter 9's engine with workers. Draft tokens are batch tokens like any others, verified by
    chapter 9's own sample; greedy output is transformers', and drafts were accepted, so verification really
    ran on two ranks."""
    prompts = ["ROMEO:\n", "O, " * 12, "First Citizen:\nBefore we proceed any further, hear me speak."]
    llm = LLM(device="cpu", num_kv_blocks=64, tensor_parallel_size=2, speculative_config=speculative_config)
    try:
        assert type(llm.engine).__name__ == "SpecDecodeEngine" and llm.engine.model_runner.workers is not None
        from minivllm.book.mechanism_checks import greedy_reference

        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        tokenizer = llm.get_tokenizer()
        for prompt, output in zip(prompts, outputs):
            assert list(output.outputs[0].token_ids) == greedy_reference(tokenizer(prompt).input_ids, 24)
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        llm.shutdown()


def test_every_rank_the_driver_included_reads_only_its_shard(monkeypatch):
    """Issue 27: the driver's model is rank 0's shard read from the checkpoint with the same function as the
    workers', not a whole model sharded in place."""
    from minivllm.distributed.layers import ColumnParallelLinear
    from minivllm.distributed.shard import load_shard

    ranks_read_here = []

    def recording(model, dtype, device, rank, world_size):
        ranks_read_here.append((rank, world_size))
        return load_shard(model, dtype, device, rank, world_size)
    monkeypatch.setattr(LLMEngine, "load_shard", staticmethod(recording))
    llm = LLM(device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    try:
        assert ranks_read_here == [(0, 2)]  # this process read rank 0's shard only; rank 1 read in its process
        q_proj = llm.engine.model.model.layers[0].self_attn.q_proj
        assert isinstance(q_proj, ColumnParallelLinear) and q_proj.weight.shape[0] == llm.engine.model.config.num_heads \
            * llm.engine.model.config.head_dim
    finally:
        llm.shutdown()


def test_a_killed_worker_fails_the_requests_naming_its_rank(monkeypatch):
    monkeypatch.setattr(LLMEngine, "timeout_s", 10.0)
    llm = LLM(device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        [pid] = worker_pids(llm)
        os.kill(pid, signal.SIGKILL)
        assert gone([pid])
        start = time.monotonic()
        with pytest.raises(EngineStepError, match="rank 1 died"):
            llm.generate(["ROMEO:"], GREEDY, use_tqdm=False)
        with pytest.raises(EngineStepError, match="rank 1 died"):  # and again, at once: no hang, no retry
            llm.generate(["JULIET:"], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 5
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_a_worker_killed_mid_step_is_detected_not_waited_for(monkeypatch):
    """Killed while the driver waits in an all-reduce: gloo sees the closed connection (or times out)."""
    monkeypatch.setattr(LLMEngine, "timeout_s", 5.0)
    llm = LLM(device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
    [pid] = worker_pids(llm)
    model, calls = llm.engine.model, []
    original = model.model.layers[1].forward

    def kill_then_forward(*args, **kwargs):  # the driver's layer 1 runs after rank 1 is gone
        if not calls:
            calls.append(os.kill(pid, signal.SIGKILL))
            gone([pid])
        return original(*args, **kwargs)
    monkeypatch.setattr(model.model.layers[1], "forward", kill_then_forward)
    start = time.monotonic()
    try:
        with pytest.raises(EngineStepError, match="rank 1"):
            llm.generate(["ROMEO:"], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 15
    finally:
        llm.shutdown()


SCRIPT = """
import sys
from minivllm import LLM, SamplingParams
llm = LLM(device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
print(*[p.pid for p in llm.engine.workers.processes], flush=True)
llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
raise RuntimeError("the driver fails")
"""


def test_no_orphans_when_the_driver_raises():
    """The driver's script dies with an exception, without shutdown(): the finaliser stops the workers."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 1 and "the driver fails" in done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert pids and gone(pids, within_s=5)


def test_the_start_method_follows_vllm(monkeypatch):
    from minivllm.distributed.executor import worker_start_method

    for name in ("VLLM_WORKER_MULTIPROC_METHOD", "MINIVLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.delenv(name, raising=False)
    assert worker_start_method() == ("fork", "the default on Linux")
    monkeypatch.setenv("MINIVLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert worker_start_method() == ("spawn", "MINIVLLM_WORKER_MULTIPROC_METHOD=spawn")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with pytest.raises(ValueError, match="VLLM_WORKER_MULTIPROC_METHOD=fork and MINIVLLM_WORKER_MULTIPROC_METHOD="
                                         "spawn disagree"):
        worker_start_method()
    monkeypatch.delenv("MINIVLLM_WORKER_MULTIPROC_METHOD")
    assert worker_start_method() == ("fork", "VLLM_WORKER_MULTIPROC_METHOD=fork")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # fork gives way, with a warning
    with pytest.warns(UserWarning, match=r'spawn, not fork: CUDA is initialised(.|\n)*if __name__ == "__main__"'):
        assert worker_start_method() == ("spawn", "CUDA is initialised in this process")


def test_a_bad_start_method_is_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    started = []
    monkeypatch.setattr("multiprocessing.process.BaseProcess.start", lambda self: started.append(self))
    with pytest.raises(ValueError, match="VLLM_WORKER_MULTIPROC_METHOD='forkserver': .* 'fork' or 'spawn'"):
        LLM(device="cpu", num_kv_blocks=16, tensor_parallel_size=2)
    assert not started


def test_a_worker_that_fails_to_load_is_named_with_its_traceback(monkeypatch):
    """A forked worker inherits this monkeypatch: its checkpoint load raises, and the driver says so."""
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv("MINIVLLM_WORKER_MULTIPROC_METHOD", raising=False)

    def no_shard(model, dtype, device, rank, world_size):
        if rank:
            raise FileNotFoundError("model-00002-of-00002.safetensors is missing")
        return load_shard(model, dtype, device, rank, world_size)
    monkeypatch.setattr(LLMEngine, "load_shard", staticmethod(no_shard))
    with pytest.raises(RuntimeError, match=r"rank 1 failed to start:(.|\n)*FileNotFoundError: model-00002"):
        LLM(device="cpu", num_kv_blocks=16, tensor_parallel_size=2)


def test_a_worker_that_dies_without_a_traceback_is_explained_by_its_last_stderr_lines(monkeypatch):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv("MINIVLLM_WORKER_MULTIPROC_METHOD", raising=False)

    def vanish(model, dtype, device, rank, world_size):
        if rank:
            os.write(2, b"out of shared memory, giving up\n")
            os._exit(3)
        return load_shard(model, dtype, device, rank, world_size)
    monkeypatch.setattr(LLMEngine, "load_shard", staticmethod(vanish))
    with pytest.raises(RuntimeError, match=r"rank 1 died \(exit code 3\):\nout of shared memory, giving up"):
        LLM(device="cpu", num_kv_blocks=16, tensor_parallel_size=2)


def test_a_rank_reads_only_its_shard_of_the_checkpoint(tmp_path, monkeypatch):
    """load_shard equals slicing the whole model (parameters and rotary tables, a checkpoint with biases
    everywhere), and the elements it reads from the files are the shard's, not the model's."""
    import safetensors

    from minivllm.distributed.shard import load_shard, shard_model
    from minivllm.model.loader import load_model

    save_random_checkpoint(tmp_path, "llama-biases-llama3-rope")
    read_elements = []

    class CountingSlice:
        def __init__(self, stored):
            self.stored = stored

        def get_shape(self):
            return self.stored.get_shape()

        def __getitem__(self, index):
            tensor = self.stored[index]
            read_elements.append(tensor.numel())
            return tensor

    class CountingFile:
        def __init__(self, *args, **kwargs):
            self.file = safetensors.safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return CountingSlice(self.inner.get_slice(name))

        def get_tensor(self, name):
            raise AssertionError(f"{name} read whole")
    monkeypatch.setattr("minivllm.distributed.shard.safe_open", CountingFile)
    whole = load_model(str(tmp_path), device="cpu")[0]
    whole_elements = sum(p.numel() for p in whole.parameters())
    for rank in range(2):
        read_elements.clear()
        got = load_shard(str(tmp_path), None, torch.device("cpu"), rank, 2)
        expected = shard_model(load_model(str(tmp_path), device="cpu")[0], rank, 2)
        assert got.state_dict().keys() == expected.state_dict().keys() and got.config == expected.config
        assert all(torch.equal(got.state_dict()[k], v) for k, v in expected.state_dict().items())
        assert torch.equal(got.model.rotary_emb.cos, expected.model.rotary_emb.cos)
        held = sum(p.numel() for p in got.parameters())
        assert sum(read_elements) == held < 0.75 * whole_elements


def test_the_driver_never_reads_the_whole_model(monkeypatch):
    """Issue 27: LLM reads only the checkpoint's configuration before its options run, so with
    tensor_parallel_size=2 no process reads the whole model: rank 0 reads its shard, the worker its own."""
    from minivllm.model import loader

    prompt = {"prompt_token_ids": [5, 17, 42, 7, 99, 3]}
    expected = LLM(device="cpu", num_kv_blocks=32).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    def whole_model_read(*args, **kwargs):
        raise AssertionError("the whole model was read")
    monkeypatch.setattr(loader, "load_weights", whole_model_read)
    llm = LLM(device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3},
                                                {"method": "draft_model", "num_speculative_tokens": 2}])
def test_a_worker_replaying_the_journal_keeps_the_drivers_block_tables(speculative_config):
    """Each worker runs chapter 6's ModelRunner with its own block tables, made by replaying the driver's journal:
    after every step the replayed tables equal the driver's row for row, through preemptions, prefix hits and the
    blocks speculative decoding reserves between steps."""
    from minivllm.distributed.executor import replay
    from minivllm.engine.model_runner import BlockTables

    llm = LLM(device="cpu", num_kv_blocks=14, block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
              attention_backend="torch", speculative_config=speculative_config, scheduler_reserve_full_isl=False)
    runner = llm.engine.model_runner
    runner.block_tables.journal = []  # as start_workers does: the draft model's proposer reads the same tables
    worker_tables, forward, steps = BlockTables(), runner.forward, [0]

    def forward_as_a_worker_would(work):
        journal = runner.block_tables.take_journal()
        replay(worker_tables, journal)
        tables = runner.block_tables
        for request_id, row in tables.rows.items():
            mine = worker_tables.rows[request_id]
            assert worker_tables.table[mine, :int(worker_tables.lengths[mine])].tolist() == \
                tables.table[row, :int(tables.lengths[row])].tolist()
        assert set(worker_tables.rows) == set(tables.rows)
        steps[0] += 1
        return forward(work)

    runner.forward = forward_as_a_worker_would
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 200 for j in range(12 + 5 * i)]} for i in range(6)]
    prompts += [prompts[0], prompts[1]]  # prefix hits
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert steps[0] > 20 and llm.engine.scheduler.num_preemptions > 0
