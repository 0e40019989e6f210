"""Hostile GGUF files (issue 29): each crafted file is refused with "not a readable GGUF file: <path>: <field>:
...", in under a second and under 100 MB, before anything the file declares is allocated. The refusals run in
one fresh process whose peak RSS is measured (resource.getrusage), so no crafted file can hide behind another."""

import json
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf import GGUFWriter

from minivllm.model.gguf_loader import DEFAULT_MAX_MODEL_LEN, load_gguf

TINY = {"block_count": 1, "embedding_length": 8, "feed_forward_length": 16, "attention.head_count": 2,
        "attention.head_count_kv": 1, "attention.key_length": 4, "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 10000.0, "context_length": 64, "vocab_size": 32}
TINY_TENSORS = {"token_embd.weight": (32, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
                "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8), "blk.0.attn_v.weight": (4, 8),
                "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,), "blk.0.ffn_gate.weight": (16, 8),
                "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}


def tiny_llama(path, tensors=None, extra=None, **metadata):
    """A llama GGUF file of a 1-layer model (numpy shapes, slowest first); metadata values replace TINY's
    (None drops a key, a str/float/int is written with that type), `extra` adds keys as they are."""
    writer = GGUFWriter(str(path), "llama")
    for key, value in ({**TINY, **metadata} | (extra or {})).items():
        key = key if key.startswith(("general.", "tokenizer.")) else f"llama.{key}"
        if value is None:
            continue
        add = {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32,
               list: writer.add_array}[type(value)]
        add(key, value)
    rng = np.random.default_rng(0)
    for name, shape in (TINY_TENSORS if tensors is None else tensors).items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def header(tensor_count=0, kv_count=0, version=3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensor_count, kv_count)


def text(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


def kv(key: bytes, value_type: int, payload: bytes) -> bytes:
    return text(key) + struct.pack("<I", value_type) + payload


def tensor_info(name=b"token_embd.weight", dims=(8, 32), tensor_type=0, offset=0) -> bytes:
    return text(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", tensor_type, offset)


RAW = {  # name: (bytes, the field the refusal names)
    "empty": (b"", "header"),
    "not-gguf": (b"PK\x03\x04" + bytes(40), "magic"),
    "version-1": (header(version=1), "version"),
    "kv-count-2e62": (header(kv_count=2**62), "metadata_kv_count"),
    "tensor-count-2e62": (header(tensor_count=2**62), "tensor_count"),
    "array-2e62-items": (header(kv_count=1) + kv(b"a", 9, struct.pack("<IQ", 0, 2**62)) + bytes(8), "a: an array"),
    "string-array-2e62": (header(kv_count=1) + kv(b"a", 9, struct.pack("<IQ", 8, 2**62)), "a: an array"),
    "key-length-2e62": (header(kv_count=1) + struct.pack("<Q", 2**62) + bytes(16), "metadata[0].key"),
    "value-string-2e62": (header(kv_count=1) + kv(b"a", 8, struct.pack("<Q", 2**62)) + bytes(16), "a: needs"),
    "unknown-value-type": (header(kv_count=1) + kv(b"a", 13, bytes(8)), "a: unknown value type 13"),
    "key-not-utf8": (header(kv_count=1) + kv(b"\xff\xfe", 4, bytes(4)), "metadata[0].key: not UTF-8"),
    "nested-arrays": (header(kv_count=1) + kv(b"a", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1)
                                              + struct.pack("<IQ", 0, 1) + bytes(1)), "a: arrays nested"),
    "duplicate-key": (header(kv_count=2) + kv(b"a", 4, bytes(4)) * 2, "a: appears twice"),
    "tensor-0-dims": (header(tensor_count=1) + tensor_info(dims=()), "token_embd.weight: 0 dimensions"),
    "tensor-100-dims": (header(tensor_count=1) + text(b"t") + struct.pack("<I", 100) + bytes(800), "t: 100 dimensions"),
    "tensor-dim-2e63": (header(tensor_count=1) + tensor_info(dims=(2**63, 2)), "token_embd.weight: shape"),
    "tensor-dim-0": (header(tensor_count=1) + tensor_info(dims=(0, 4)), "token_embd.weight: shape"),
    "tensor-type-999": (header(tensor_count=1) + tensor_info(tensor_type=999), "unknown tensor type 999"),
    "tensor-type-i32": (header(tensor_count=1) + tensor_info(tensor_type=26), "not a weight type"),
    "tensor-past-eof": (header(tensor_count=1) + tensor_info(dims=(8, 4), offset=4096) + bytes(200),
                        "token_embd.weight: 128 bytes at data offset 4,096: past the end"),
    "bad-alignment": (header(tensor_count=0, kv_count=1) + kv(b"general.alignment", 4, struct.pack("<I", 3)),
                      "general.alignment"),
}
MODEL = {  # name: (tiny_llama's arguments, the field the refusal names)
    "70b-metadata-no-tensors": (dict(tensors={}, block_count=80, embedding_length=8192, feed_forward_length=28672,
                                     **{"attention.head_count": 64, "attention.head_count_kv": 8,
                                        "attention.key_length": 128, "vocab_size": 128256}),
                                "llama.block_count: 80 layers, in a file of 0 tensors"),
    "head-count-0": (dict(**{"attention.head_count": 0}), "llama.attention.head_count: 0"),
    "heads-not-divisible": (dict(**{"attention.head_count_kv": 3}), "llama.attention.head_count_kv: 3 does not divide"),
    "eps-nan": (dict(**{"attention.layer_norm_rms_epsilon": float("nan")}), "llama.attention.layer_norm_rms_epsilon"),
    "eps-inf": (dict(**{"attention.layer_norm_rms_epsilon": float("inf")}), "llama.attention.layer_norm_rms_epsilon"),
    "eps-negative": (dict(**{"attention.layer_norm_rms_epsilon": -1.0}), "llama.attention.layer_norm_rms_epsilon"),
    "rope-base-0": (dict(**{"rope.freq_base": 0.0}), "llama.rope.freq_base"),
    "block-count-string": (dict(block_count="two"), "llama.block_count: 'two'"),
    "no-embedding-length": (dict(embedding_length=None), "llama.embedding_length: missing"),
    "context-length-0": (dict(context_length=0), "llama.context_length"),
    "wrong-shape": (dict(tensors={**TINY_TENSORS, "token_embd.weight": (4, 8)}), "token_embd.weight: shape"),
    "missing-tensor": (dict(tensors={k: v for k, v in TINY_TENSORS.items() if "ffn_up" not in k}), "tensors: 1 of"),
    "architecture-gpt2": (dict(extra={"general.architecture": "gpt2"}), "general.architecture"),
    "tokens-without-scores": (dict(extra={"tokenizer.ggml.model": "llama",
                                          "tokenizer.ggml.tokens": [f"t{i}" for i in range(32)]}),
                              "tokenizer.ggml.scores: missing"),
    "scores-too-short": (dict(extra={"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"],
                                     "tokenizer.ggml.scores": [0.0]}), "tokenizer.ggml.scores: must be an array"),
}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    files = {}
    for name, (data, field) in RAW.items():
        (folder / f"{name}.gguf").write_bytes(data)
        files[name] = (str(folder / f"{name}.gguf"), field)
    for name, (kwargs, field) in MODEL.items():
        files[name] = (str(tiny_llama(folder / f"{name}.gguf", **kwargs)), field)
    files["directory"] = (str(folder), "file: not a regular file")
    files["dev-zero"] = ("/dev/zero", "file: not a regular file")
    return files


REFUSE_ALL = textwrap.dedent('''
    import json, resource, sys, time
    from minivllm.model.gguf_loader import load_gguf
    files, warm_up = json.loads(sys.argv[1]), sys.argv[2]
    load_gguf(warm_up)  # a valid file first: what a running process has imported already is not the refusal's
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = {}
    for name, path in files.items():
        start = time.perf_counter()
        try:
            load_gguf(path)
            error = None
        except ValueError as refusal:
            error = str(refusal)
        except Exception as other:
            error = f"RAW {type(other).__name__}: {other}"
        results[name] = {"error": error, "seconds": time.perf_counter() - start}
    growth_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline
    print(json.dumps({"results": results, "rss_growth_mb": growth_kib / 1024}))
''')


def test_every_crafted_file_is_refused_fast_and_small(crafted, tmp_path):
    warm_up = str(tiny_llama(tmp_path / "valid.gguf"))
    done = subprocess.run([sys.executable, "-c", REFUSE_ALL, json.dumps({k: p for k, (p, _) in crafted.items()}), warm_up],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (path, field) in crafted.items():
        result = report["results"][name]
        assert result["error"] is not None, f"{name}: loaded"
        assert result["error"].startswith(f"not a readable GGUF file: {path}: "), (name, result["error"])
        assert field in result["error"], (name, field, result["error"])
        assert result["seconds"] < 1.0, (name, result)  # a bounded refusal, not a benchmark
    assert report["rss_growth_mb"] < 100, report["rss_growth_mb"]


def test_a_huge_context_length_does_not_size_the_rope_tables(tmp_path):
    path = tiny_llama(tmp_path / "long.gguf", context_length=2**26)
    model, _ = load_gguf(path)
    assert model.config.max_model_len == DEFAULT_MAX_MODEL_LEN
    assert max(b.shape[0] for name, b in model.named_buffers() if name.endswith("cos")) == DEFAULT_MAX_MODEL_LEN
    model, _ = load_gguf(path, max_model_len=128)
    assert model.config.max_model_len == 128
    with pytest.raises(ValueError, match=r"long.gguf: max_model_len: 1: must be from 2"):
        load_gguf(path, max_model_len=1)
    short = tiny_llama(tmp_path / "short.gguf")
    with pytest.raises(ValueError, match=r"max_model_len: 65: must be from 2 to the file's context_length 64"):
        load_gguf(short, max_model_len=65)


def test_the_tiny_file_loads_and_a_model_too_big_for_memory_is_refused(tmp_path, monkeypatch):
    path = tiny_llama(tmp_path / "tiny.gguf")
    model, tokenizer = load_gguf(path)
    assert tokenizer is None and model.config.num_layers == 1
    written = np.random.default_rng(0).standard_normal(TINY_TENSORS["token_embd.weight"]).astype(np.float32)
    assert np.array_equal(model.model.embed_tokens.weight.detach().numpy(), written)  # the file's, not an init
    import psutil

    class Small:
        available = 1000
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Small)
    with pytest.raises(ValueError, match=r"tiny.gguf: tensors: the model takes .* GiB loaded, and 0.0 GiB are available"):
        load_gguf(path)


def test_llm_reads_gguf_through_chapter_1s_file_loaders(tmp_path):
    from minivllm import LLM, SamplingParams
    from minivllm.model.loader import FILE_LOADERS

    assert FILE_LOADERS[".gguf"] is load_gguf
    llm = LLM(str(tiny_llama(tmp_path / "tiny.gguf")), num_kv_blocks=8, block_size=4)
    [out] = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
