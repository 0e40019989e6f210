"""Issue 41 item 7 (the red team's smaller points), each with its reproducer: a checkpoint folder is checked as a
GGUF file is (an index that points out of the folder, a tensor of the wrong shape, config.json dimensions far
beyond the files: each refused by name before any weight is allocated or read), for the one-process loader and
for tensor-parallel shards; `serve --api-key ""` is refused instead of serving without authentication; and a
request head over the server's 64 KiB is refused even when it arrives in one piece (loopback only)."""

import json
import resource
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import cli
from minivllm.distributed.shard import load_shard
from minivllm.model.loader import DEFAULT_MODEL, load_model, weight_files


@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, folder)
    return folder


def write_index(folder, files_by_tensor: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files_by_tensor}))


@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/model.safetensors",
                                  "..", "model.bin"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(checkpoint, tmp_path, name):
    """The reproducer: model.safetensors.index.json names a valid weights file outside the folder. Refused,
    naming the entry; the outside file is never opened (it is even valid weights)."""
    shutil.copy(checkpoint / "model.safetensors", tmp_path / "outside.safetensors")
    (checkpoint / "sub").mkdir()
    shutil.copy(checkpoint / "model.safetensors", checkpoint / "sub" / "model.safetensors")
    tensors = list(load_file(checkpoint / "model.safetensors"))
    write_index(checkpoint, {tensor: name for tensor in tensors})
    with pytest.raises(ValueError, match=r"model.safetensors.index.json lists .*a weights file must be a file of "
                                         r"the checkpoint folder"):
        weight_files(checkpoint)
    with pytest.raises(ValueError, match="must be a file of the checkpoint folder"):
        load_model(checkpoint, device="cpu")


def test_an_index_that_is_not_an_index_is_refused(checkpoint):
    for text in ("[1, 2]", '{"weight_map": ["model.safetensors"]}', '{"weight_map": {"a": 5}}', "{" * 100000):
        (checkpoint / "model.safetensors.index.json").write_text(text)
        with pytest.raises(ValueError, match="model.safetensors.index.json"):
            weight_files(checkpoint)
    write_index(checkpoint, {name: "model.safetensors" for name in load_file(checkpoint / "model.safetensors")})
    assert weight_files(checkpoint) == [checkpoint / "model.safetensors"]


def test_a_tensor_of_the_wrong_shape_is_refused_not_broadcast(checkpoint):
    """The reproducer: a [1, hidden] embedding where config.json says [vocab, hidden] was copied into every row
    (broadcast) without a word. Refused by name, with both shapes; by the loader and by a tensor-parallel shard."""
    weights = load_file(checkpoint / "model.safetensors")
    name = next(n for n in weights if n.endswith("embed_tokens.weight"))
    vocab, hidden = weights[name].shape
    weights[name] = weights[name][:1].clone()
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    message = rf"{name} has shape \[1, {hidden}\], but config.json makes it \[{vocab}, {hidden}\]"
    with pytest.raises(ValueError, match=message):
        load_model(checkpoint, device="cpu")
    with pytest.raises(ValueError, match=message):
        load_shard(str(checkpoint), None, torch.device("cpu"), 0, 1)


def test_config_dimensions_beyond_the_files_are_refused_before_allocating(checkpoint):
    """The reproducer: config.json's vocab_size and intermediate_size raised far beyond the weights (a model of
    tens of GiB). Refused from the files' headers, naming the tensor, with the process's peak memory nearly
    unchanged: nothing of that size was allocated."""
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(vocab_size=2**22, intermediate_size=2**20)
    (checkpoint / "config.json").write_text(json.dumps(config))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=r"has shape \[\d+, \d+\], but config.json makes it"):
        load_model(checkpoint, device="cpu")
    with pytest.raises(ValueError, match="but config.json makes it"):
        load_shard(str(checkpoint), None, torch.device("cpu"), 0, 1)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) * 1024
    assert grown < 256 * 2**20, f"peak memory grew by {grown / 2**20:.0f} MiB"


def test_a_missing_tensor_is_named_before_loading(checkpoint):
    weights = load_file(checkpoint / "model.safetensors")
    name = next(n for n in weights if n.endswith("layers.0.mlp.up_proj.weight"))
    del weights[name]
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"weights missing from .*{name}"):
        load_model(checkpoint, device="cpu")


def test_the_checked_checkpoint_still_loads_the_same_weights(checkpoint):
    model = load_model(checkpoint, device="cpu")[0]
    reference = load_file(checkpoint / "model.safetensors")
    for name, parameter in model.named_parameters():
        if name in reference:
            assert torch.equal(parameter.detach(), reference[name].to(parameter.dtype)), name


def test_serve_with_an_empty_api_key_is_refused(capsys, monkeypatch):
    """The reproducer: `serve --api-key ""` served every route without authentication. Refused before any model
    loads, naming the flag; a blank key too."""
    import minivllm.entrypoints.llm

    monkeypatch.setattr(minivllm.entrypoints.llm, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for key in ("", "   "):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["serve", "--api-key", key])
        assert exit_info.value.code == 2
        assert "argument --api-key: an empty key would let every client in" in capsys.readouterr().err


def raw_status(server, head: bytes) -> int:
    """The status line's code for a request head sent in one piece; 0 if the server closed without one."""
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                return 0
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def test_a_request_head_over_64_kib_is_refused_even_in_one_piece():
    """The reproducer: 70 KB of headers in one send were accepted (uvicorn's h11 bound applies only to a head
    still arriving). Now a 431 (or uvicorn's 400), while a head of 60 KB is served."""
    from minivllm import LLM
    from minivllm.entrypoints.openai.launcher import BackgroundServer

    with BackgroundServer(LLM(num_kv_blocks=32)) as server:
        limit = server.app.state.serving.limits.max_head_bytes
        assert limit == 64 << 10
        for size, allowed in ((60_000, True), (70_000, False), (limit + 200, False)):
            head = (b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * (size - 60) + b"\r\n"
                    b"Connection: close\r\n\r\n")
            status = raw_status(server, head)
            assert (status == 200) == allowed and (allowed or status in (400, 431, 0)), (size, status)
