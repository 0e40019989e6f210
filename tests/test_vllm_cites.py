"""The vLLM citation checker (make vllm-cites) on a made-up release and book: what it finds, what it refuses."""

import json

from minivllm.tools import vllm_cites

RELEASE = {
    "vllm/__init__.py": "",
    "vllm/v1/core/sched/scheduler.py": "class Scheduler:\n    def schedule(self):\n        self.budget = 1\n",
    "vllm/v1/core/block_pool.py": "from tokenizers.decoders import DecodeStream\n\nclass BlockPool:\n    pass\n",
    "vllm/v1/worker/gpu/model_runner.py": "class GPUModelRunner:\n    pass\n",
}


def make_tree(root, files):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def run(tmp_path, capsys, markdown):
    make_tree(tmp_path / "src", RELEASE)
    (tmp_path / "book" / "notebooks").mkdir(parents=True)
    (tmp_path / "book" / "book").mkdir()
    cell = {"cell_type": "markdown", "metadata": {}, "source": markdown.splitlines(keepends=True)}
    (tmp_path / "book" / "notebooks" / "01_x.ipynb").write_text(json.dumps({"cells": [cell]}))
    status = vllm_cites.main(["--source", str(tmp_path / "src"), "--root", str(tmp_path / "book"), "--pin", "0.33.0"])
    return status, capsys.readouterr().out


def test_present_paths_and_names_pass(tmp_path, capsys):
    status, out = run(tmp_path, capsys, "`Scheduler.schedule` (`vllm/v1/core/sched/scheduler.py`) and "
                      "`vllm/v1/core/block_pool.py` (`BlockPool`); the runner in `vllm/v1/worker/gpu/`; "
                      "minivllm/core/scheduler.py is ours, github.com/vllm-project/vllm/pull/1 a link; "
                      "`vllm/attention/layer.py` in v0.11 and `vllm/worker/model_runner.py` (v0.6) are history.")
    assert status == 0, out
    assert "3 cited paths, 2 cited names: all present" in out


def test_missing_file_and_names_are_listed_with_their_cell(tmp_path, capsys):
    status, out = run(tmp_path, capsys, "`vllm/attention/layer.py` (`Attention`) and "
                      "`Scheduler.preempt` in `vllm/v1/core/sched/scheduler.py`\n\n"
                      "| here | vLLM v0.33.0 |\n|---|---|\n| x | `KVCacheManager` with `vllm/v1/core/block_pool.py` |\n")
    assert status == 1
    assert "notebooks/01_x.ipynb [0]: vllm/attention/layer.py does not exist" in out
    assert "Scheduler.preempt is not defined in vllm/v1/core/sched/scheduler.py" in out
    assert "KVCacheManager (cited with vllm/v1/core/block_pool.py) is defined nowhere in the release" in out


def test_a_table_pinned_to_another_release_is_reported(tmp_path, capsys):
    status, out = run(tmp_path, capsys, "| here | vLLM v0.11.0 |\n|---|---|\n| a | `vllm/v1/core/block_pool.py` |\n")
    assert status == 1 and "table pinned to vLLM 0.11.0, the book's pin is 0.33.0" in out


def test_a_source_folder_without_vllm_is_refused(tmp_path):
    try:
        vllm_cites.main(["--source", str(tmp_path)])
    except SystemExit as error:
        assert "no vllm/__init__.py" in str(error)
    else:
        raise AssertionError("a folder without vllm/ was accepted")


def test_a_wheel_is_read_through_its_python_files(tmp_path, capsys):
    import zipfile

    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux1_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in RELEASE.items():
            archive.writestr(name, text)
        archive.writestr("vllm/_C.abi3.so", b"\0" * 64)  # a binary: found, its bytes not extracted
    root = tmp_path / "book"
    (root / "notebooks").mkdir(parents=True)
    (root / "book").mkdir()
    (root / "book" / "page.md").write_text("`BlockPool` (`vllm/v1/core/block_pool.py`), `vllm/_C.abi3.so`, "
                                           "`Gone` (`vllm/v1/core/block_pool.py`)\n")
    status = vllm_cites.main(["--wheel", str(wheel), "--cache", str(tmp_path / "cache"), "--root", str(root)])
    out = capsys.readouterr().out
    assert status == 1 and out.splitlines()[0] == "book/page.md: Gone is not defined in vllm/v1/core/block_pool.py"
    extracted = tmp_path / "cache" / wheel.stem / "vllm"
    assert (extracted / "v1" / "core" / "block_pool.py").read_text() == RELEASE["vllm/v1/core/block_pool.py"]
    assert (extracted / "_C.abi3.so").stat().st_size == 0
