"""The command line: vLLM's engine arguments on generate, serve and bench, mapped onto LLM(...); every value
refused before a model loads, with an error naming the flag; explain-cache's inputs checked and bounded."""

import inspect
import os

import pytest

from minivllm import cli
from minivllm.engine.arg_utils import EngineArgs, human_readable_int


@pytest.fixture
def no_model_load(monkeypatch):
    """A refusal must come before any weights are read: loading raises here."""
    import minivllm.entrypoints.llm
    import minivllm.model.loader

    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the command line was checked")

    monkeypatch.setattr(minivllm.model.loader, "load_model", load_model)
    monkeypatch.setattr(minivllm.entrypoints.llm, "load_model", load_model)


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--data-parallel-size", "0"], "--data-parallel-size"),
    (["serve", "--data-parallel-size", "64"], "--data-parallel-size"),
    (["serve", "--tensor-parallel-size", "100000"], "--tensor-parallel-size"),
    (["generate", "x", "--block-size", "0"], "--block-size"),
    (["generate", "x", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["generate", "x", "--max-num-batched-tokens", "-5"], "--max-num-batched-tokens"),
    (["generate", "x", "--max-model-len", "1"], "--max-model-len"),
    (["generate", "x", "--seed", "-1"], "--seed"),
    (["generate", "x", "--seed", str(2**63)], "--seed"),
    (["generate", "x", "--dtype", "int8"], "--dtype"),
    (["generate", "x", "--attention-backend", "FLASH_ATTN"], "--attention-backend"),
    (["generate", "x", "--kv-cache-memory-bytes", "1.5K"], "--kv-cache-memory-bytes"),
    (["generate", "x", "--kv-cache-memory-bytes", "1000T"], "--kv-cache-memory-bytes"),
    (["generate", "x", "--speculative-config", "{"], "--speculative-config"),
    (["generate", "x", "--max-tokens", "0"], "max_tokens"),
    (["bench", "--max-num-seqs", "0"], "--max-num-seqs"),
])
def test_bad_values_are_refused_before_anything_loads(argv, flag, capsys, no_model_load):
    assert flag in refused(argv, capsys)


def test_data_parallel_size_is_bounded_by_the_machine(monkeypatch, capsys, no_model_load):
    monkeypatch.setattr(cli, "replica_capacity", lambda: 3)
    err = refused(["serve", "--data-parallel-size", "4"], capsys)
    assert "--data-parallel-size" in err and "at most 3 replicas" in err


def test_human_readable_integers_as_vllm_reads_them():
    assert [human_readable_int(t) for t in ("1k", "1K", "25.6k", "2G", "512")] == [1000, 1024, 25600, 2**31, 512]


def test_engine_arguments_map_onto_llm_with_its_defaults():
    import argparse

    from minivllm.entrypoints.llm import LLM, LLM_OPTIONS

    parameters = inspect.signature(LLM.__init__).parameters
    signature = {name: p.default for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY or name == "model"}
    signature |= {name: option.default for name, option in LLM_OPTIONS.items()}  # the later chapters' keywords
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    defaults = EngineArgs.from_cli_args(parser.parse_args([])).llm_kwargs()
    for name, value in defaults.items():  # every flag is an LLM argument, and says nothing unless given
        assert name in signature, name
        assert value == signature[name], (name, value, signature[name])
    argv = ["--model", "m", "-tp", "2", "--max-model-len", "1k", "--block-size", "32", "--no-enable-prefix-caching",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "2K", "--dtype", "half", "--seed", "7",
            "--attention-backend", "TRITON_ATTN", "--kv-cache-memory-bytes", "64M", "--no-enable-chunked-prefill",
            "--num-gpu-blocks-override", "100", "-sc", '{"method": "ngram", "num_speculative_tokens": 2}',
            "--kv-offloading-size", "2.5", "--kv-offloading-backend", "native", "-q", "int8_per_channel_weight_only"]
    kwargs = EngineArgs.from_cli_args(parser.parse_args(argv)).llm_kwargs()
    assert kwargs == {"model": "m", "tensor_parallel_size": 2, "max_model_len": 1000, "block_size": 32,
                      "enable_prefix_caching": False, "max_num_seqs": 8, "max_num_batched_tokens": 2048,
                      "dtype": "float16", "seed": 7, "attention_backend": "triton",
                      "kv_cache_memory_bytes": 64 * 2**20, "enable_chunked_prefill": False, "num_kv_blocks": 100,
                      "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
                      "kv_offloading_size": 2.5, "kv_offloading_backend": "native",
                      "quantization": "int8_per_channel_weight_only"}
    assert EngineArgs.from_cli_args(parser.parse_args(["--max-model-len", "auto"])).max_model_len is None


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "lots"])
def test_kv_offloading_size_is_a_positive_number_of_gib(value, capsys):
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-offloading-size", value])
    assert "--kv-offloading-size" in capsys.readouterr().err


def test_serve_kv_offloading_size_gives_the_engine_a_tier_of_that_size():
    import argparse

    from minivllm.entrypoints.llm import LLM

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    kwargs = EngineArgs.from_cli_args(parser.parse_args(["--kv-offloading-size", "0.001",
                                                         "--num-gpu-blocks-override", "8"])).llm_kwargs()
    llm = LLM(**kwargs)
    assert llm.engine.kv_manager.store.cpu.capacity_blocks == round(0.001 * 2**30) // llm.engine.kv_cache.bytes_per_block
    assert llm.stats()["kv_offload_cpu_bytes"] == 0


def test_generate_passes_the_engine_arguments(monkeypatch, capsys):
    import minivllm

    seen = {}

    class RecordingLLM(minivllm.LLM):
        def __init__(self, **kwargs):
            seen.update(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(minivllm, "LLM", RecordingLLM)
    assert cli.main(["generate", "ROMEO:", "--max-tokens", "3", "--block-size", "8", "--no-enable-prefix-caching",
                     "--num-gpu-blocks-override", "40", "--attention-backend", "torch", "--max-num-seqs", "4"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")
    assert (seen["block_size"], seen["enable_prefix_caching"], seen["num_kv_blocks"], seen["attention_backend"],
            seen["max_num_seqs"]) == (8, False, 40, "torch", 4)


def test_help_keeps_its_layout(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert '\n    python -m minivllm generate "ROMEO:" --max-tokens 50\n' in out
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--tensor-parallel-size", "--max-model-len", "--block-size", "--no-enable-prefix-caching",
                 "--max-num-seqs", "--max-num-batched-tokens", "--dtype", "--seed", "--attention-backend",
                 "--kv-cache-memory-bytes"):
        assert flag in out, flag


# ------------------------------------------------------------------ explain-cache's inputs


def test_explain_cache_block_size_is_checked(tmp_path, capsys, no_model_load):
    (tmp_path / "a.txt").write_text("ROMEO: hello")
    for size in ("0", "-1"):
        err = refused(["explain-cache", str(tmp_path / "a.txt"), str(tmp_path / "a.txt"), "--block-size", size], capsys)
        assert "--block-size" in err


@pytest.mark.parametrize("name, content, message", [
    ("empty.txt", b"   \n", "empty prompt"),
    ("empty.json", b"[]", "non-empty list"),
    ("bad.json", b'[{"role": "user"}]', "message 0"),
    ("notjson.json", b"[{", "not JSON"),
    ("latin1.txt", b"caf\xe9", "not UTF-8"),
])
def test_explain_cache_refuses_unreadable_prompts(tmp_path, name, content, message, capsys, no_model_load):
    (tmp_path / name).write_bytes(content)
    (tmp_path / "ok.txt").write_text("ROMEO: hello")
    err = refused(["explain-cache", str(tmp_path / "ok.txt"), str(tmp_path / name)], capsys)
    assert name in err and message in err


def test_explain_cache_bounds_what_it_reads(tmp_path, capsys, no_model_load):
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as file:  # 50 MB, sparse: nothing is written, and nothing must be read
        file.truncate(50 * 10**6)
    assert "at most" in refused(["explain-cache", str(huge), str(huge)], capsys)
    if os.path.exists("/dev/zero"):
        assert "not a regular file" in refused(["explain-cache", "/dev/zero", str(huge)], capsys)
    assert "No such file" in refused(["explain-cache", str(tmp_path / "missing.txt"), str(huge)], capsys)
