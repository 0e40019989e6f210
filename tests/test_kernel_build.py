"""minivllm/kernels/build.py: the C++ kernels built for the CPU that runs them, and every way a build can go wrong.

- **The instruction set**: chosen from the CPU's flags, capped by MINIVLLM_CPU_ISA (an unknown value is an error
  naming the choices); each level builds into its own folder, so a venv moved to another CPU never loads a library
  built for instructions it lacks.
- **Turned off** (MINIVLLM_CPU_KERNELS=off): every kernel is unavailable, the engine falls back to the reference
  backend and torch's products, without a warning, and its greedy tokens do not change.
- **No compiler** and **a compile error** are told apart: the first is KernelUnavailable naming the compiler, the
  second KernelBuildError with the compiler's own message; either is raised again on a later call without running
  the compiler again, and the engine's fallback warns once, with the reason.
- **A compiler without OpenMP** (a wrapper that refuses -fopenmp): the kernel builds without it and is correct.
- **The lock**: a build waits for a live holder (and gives up naming it), and a holder killed mid-build leaves no
  lock behind.
- **No change to the process environment**.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from minivllm.kernels import build
from minivllm.kernels.build import (ISA_FLAGS, KernelBuildError, KernelUnavailable, build_key, isa_level,
                                    kernel_problem, load_kernel, source_region)
from minivllm.kernels.cpu_attention import load_cpu_attention
from tests.conftest import kernel_missing

AVX512 = frozenset(set().union(*(build.ISA_NEEDS[level] for level in ("avx2", "avx512"))))


def run_python(code: str, **env) -> list[str]:
    """`code` in a fresh Python with `env` on top of this one's, MINIVLLM_CPU_KERNELS unset unless given: these
    tests are about the build itself, whatever path the run around them forces."""
    environment = {**{k: v for k, v in os.environ.items() if k != "MINIVLLM_CPU_KERNELS"}, **env}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environment, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")[:-1]


def test_the_level_is_the_highest_the_cpu_has_capped_by_the_environment(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("MINIVLLM_CPU_ISA", raising=False)
    assert isa_level(frozenset({"sse2"})) == "portable"
    assert isa_level(frozenset({"avx2", "fma"})) == "portable"  # AVX2 without F16C: not the level
    assert isa_level(frozenset({"avx2", "fma", "f16c"})) == "avx2"
    assert isa_level(AVX512) == "avx512"
    assert isa_level(AVX512 | {"avx512_bf16"}) == "avx512"  # BF16 without VNNI: the levels are cumulative
    assert isa_level(AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile"}) == "avx512_bf16"
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx2")
    assert isa_level(AVX512 | {"avx512_vnni", "avx512_bf16"}) == "avx2"
    assert isa_level(frozenset()) == "portable"  # a cap never raises the level above the CPU's
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_ISA='avx1024': expected one of portable, avx2"):
        isa_level(AVX512)
    monkeypatch.setattr(build.platform, "machine", lambda: "arm64")
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx512_bf16")
    assert isa_level(AVX512) == "portable"  # x86's flags mean nothing on ARM: the portable loops


def test_each_level_and_each_source_builds_into_a_folder_of_its_own():
    if kernel_missing(lambda: build.compiler_identity(build.compiler())):
        pytest.skip("no C++ compiler here")
    ops, gemv = build.CSRC / "cpu_ops.cpp", build.CSRC / "cpu_gemv.cpp"
    keys = {build_key(ops, level, ()) for level in ISA_FLAGS}
    assert len(keys) == len(ISA_FLAGS)
    assert build_key(ops, "portable", ()) != build_key(ops, "portable", ("-ffp-contract=off",))
    assert build_key(ops, "portable", ()) != build_key(gemv, "portable", ())


def test_regions_are_read_from_the_files_the_compiler_reads():
    text = source_region("cpu_attention.cpp", "write_kv")
    assert text.lstrip().startswith("//") and "void write_kv(" in text and "// region" not in text
    assert text in (build.CSRC / "cpu_attention.cpp").read_text()
    with pytest.raises(KeyError, match="no region 'nowhere'"):
        source_region("cpu_attention.cpp", "nowhere")


def test_turned_off_the_engine_falls_back_silently_with_the_same_tokens():
    code = """
        import warnings
        from minivllm import LLM, SamplingParams
        from minivllm.kernels.build import KernelUnavailable
        from minivllm.kernels.cpu_attention import load_cpu_attention
        try:
            load_cpu_attention()
        except KernelUnavailable as error:
            print("unavailable:", error)
        else:
            print("available")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            llm = LLM()
        print(llm.engine.model_runner.backend.__name__)
        print(sorted({type(m).__name__ for m in llm.engine.model.modules()} & {"GemvLinear", "CPURMSNorm"}))
        print("warnings:", [str(w.message) for w in caught if "kernel" in str(w.message)])
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        print(llm.generate(["ROMEO:\\n"], params, use_tqdm=False)[0].outputs[0].token_ids)
    """
    off = run_python(code, MINIVLLM_CPU_KERNELS="off")
    assert off[0] == "unavailable: the C++ kernels are turned off (MINIVLLM_CPU_KERNELS=off)"
    assert off[1:4] == ["PagedAttention", "[]", "warnings: []"]
    if not kernel_missing(load_cpu_attention):
        on = run_python(code)
        assert on[:2] == ["available", "CPUPagedAttention"] and "CPURMSNorm" in on[2]  # the GEMV: where selectable
        assert on[4] == off[4]  # the same greedy tokens with or without kernels


def test_no_compiler_is_unavailable_naming_it_and_the_engine_warns_once(tmp_path):
    code = """
        import warnings
        from minivllm import LLM
        from minivllm.kernels.build import KernelBuildError, KernelUnavailable
        from minivllm.kernels.cpu_attention import load_cpu_attention
        from minivllm.attention.selector import attention_backend_class
        for attempt in range(2):
            try:
                load_cpu_attention()
            except KernelUnavailable as error:
                print(type(error).__name__, error)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(attention_backend_class("auto", "cpu").__name__)
            attention_backend_class("auto", "cpu")
        print(sum("no C++ compiler" in str(w.message) for w in caught), sum("reference" in str(w.message) for w in caught))
        try:
            attention_backend_class("cpu", "cpu")
        except ImportError as error:
            print("ImportError:", error)
    """
    out = run_python(code, CXX=str(tmp_path / "no-such-c++"), MINIVLLM_KERNEL_CACHE=str(tmp_path / "cache"))
    missing = f"no C++ compiler: '{tmp_path / 'no-such-c++'}' is not on PATH"
    assert out[0] == out[1] and out[0].startswith(f"KernelUnavailable {missing}")
    assert out[2:4] == ["PagedAttention", "1 2"]  # the reason once per process, the fallback at each choice
    assert out[4].startswith("ImportError: attention backend 'cpu' needs chapter 8b's C++ kernel") and missing in out[4]


def counting_compiler(folder, refuse: str | None = None) -> tuple[str, str]:
    """A compiler that logs each call to a file, then runs the real one (refusing `refuse` as a compiler without
    OpenMP does); returns its path and the log's."""
    log, wrapper = folder / "calls.log", folder / "c++"
    refusal = f'case " $* " in *" {refuse} "*) echo "unsupported option {refuse}" >&2; exit 1;; esac\n' if refuse else ""
    real = build.shutil.which(build.compiler())
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\n{refusal}exec {real} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper), str(log)


def test_a_compile_error_shows_the_compilers_message_and_is_not_retried(tmp_path, monkeypatch):
    if kernel_missing(lambda: build.compiler_identity(build.compiler())):
        pytest.skip("no C++ compiler here")
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "broken.cpp").write_text("#include <torch/extension.h>\nint broken() { return undeclared_name; }\n")
    compiler, log = counting_compiler(tmp_path)
    monkeypatch.setattr(build, "CSRC", sources)
    monkeypatch.delenv("MINIVLLM_CPU_KERNELS", raising=False)
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("MINIVLLM_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KernelBuildError, match="broken.cpp did not compile") as first:
        load_kernel("broken", isa="portable")
    assert "undeclared_name" in str(first.value) and "error" in str(first.value)
    calls = len(open(log).readlines())
    with pytest.raises(KernelBuildError) as second:
        load_kernel("broken", isa="portable")
    assert second.value is first.value and len(open(log).readlines()) == calls  # remembered, not rebuilt
    assert "undeclared_name" in kernel_problem(lambda: load_kernel("broken", isa="portable"))
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built left to load


def test_a_compiler_without_openmp_builds_the_kernels_without_it(tmp_path):
    if kernel_missing(lambda: build.compiler_identity(build.compiler())):
        pytest.skip("no C++ compiler here")
    compiler, log = counting_compiler(tmp_path, refuse="-fopenmp")
    code = """
        import torch
        from minivllm.kernels.build import openmp_flags, compiler
        from minivllm.kernels.cpu_gemv import load_cpu_gemv
        print(openmp_flags(compiler()))
        x, w = torch.randn(3, 64), torch.randn(40, 64)
        exact = x.double() @ w.double().T
        print(bool(((load_cpu_gemv().gemv_f32(x, w) - exact).abs().max() <= 2 ** -20 * exact.abs().max())))
    """
    before = dict(os.environ)
    out = run_python(code, CXX=compiler, MINIVLLM_KERNEL_CACHE=str(tmp_path / "cache"))
    assert out == ["('-fopenmp-simd',)", "True"]
    assert not any("-fopenmp " in line + " " for line in open(log) if "cpu_gemv.cpp" in line)
    assert dict(os.environ) == before


def hold_lock(path) -> subprocess.Popen:
    code = (f"import fcntl, time\nh = open({str(path)!r}, 'a+')\nfcntl.flock(h, fcntl.LOCK_EX)\n"
            "h.write('pid holder'); h.flush()\nprint('held', flush=True)\ntime.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_a_build_waits_for_a_live_holder_and_a_killed_one_leaves_no_lock(tmp_path, monkeypatch, capsys):
    lock = tmp_path / "build.lock"
    holder = hold_lock(lock)
    monkeypatch.setattr(build, "LOCK_PATIENCE_S", 1.0)
    try:
        started = time.monotonic()
        with pytest.raises(KernelBuildError, match="held the build lock"):
            build._locked(lock)
        assert time.monotonic() - started < 30
        assert "waiting for another build" in capsys.readouterr().err
    finally:
        holder.send_signal(signal.SIGKILL)  # as a Jupyter restart kills a build
        holder.wait()
    handle = build._locked(lock)  # the operating system released the dead holder's lock
    assert handle is not None and f"pid {os.getpid()}" in lock.read_text()
    handle.close()


def test_the_kernels_work_at_every_level_this_cpu_has():
    """Each level's build of the GEMV and the int8 product against float64 (the portable loops included)."""
    if kernel_missing(lambda: load_kernel("cpu_gemv", isa="portable")):
        pytest.skip("no C++ compiler here, or the kernels are off")
    levels = list(ISA_FLAGS)[:list(ISA_FLAGS).index(isa_level()) + 1]
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 96, generator=gen), torch.randn(33, 96, generator=gen)
    exact = x.double() @ w.double().T
    for level in {"portable", levels[-1]}:  # the two ends: every level in between is another #if of the same loops
        got = load_kernel("cpu_gemv", isa=level).gemv_f32(x, w).double()
        assert (got - exact).abs().max() <= 2 ** -20 * exact.abs().max(), level


def test_a_layer_gets_its_kernel_without_a_new_lookup_per_call(monkeypatch):
    """A decode step calls the GEMV 211 times on SmolLM2: the module is kept once found, not looked up (reading
    the CPU's flags, hashing sources) at every call."""
    from torch import nn

    from minivllm.kernels import cpu_gemv
    from minivllm.kernels.cpu_gemv import GemvLinear, load_cpu_gemv

    if kernel_missing(load_cpu_gemv):
        pytest.skip("no C++ compiler here, or the kernels are off")
    layer = GemvLinear.sharing(nn.Linear(64, 8))
    want = layer(torch.ones(1, 64))

    def looked_up_again(*args, **kwargs):
        raise AssertionError("load_kernel called again")

    monkeypatch.setattr(cpu_gemv, "load_kernel", looked_up_again)
    monkeypatch.setattr(build, "cpu_flags", looked_up_again)
    assert torch.equal(layer(torch.ones(1, 64)), want)
