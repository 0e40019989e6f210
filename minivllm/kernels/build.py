"""Builds chapter 8b's C++ kernels (minivllm/kernels/csrc/*.cpp) for the CPU that runs, and loads them.

One compiler call per kernel, no ninja and no change to the process environment:

- the instruction set is chosen at run time from the CPU's own flags (`/proc/cpuinfo`, else torch's view of the
  CPU), capped by MINIVLLM_CPU_ISA; each level builds into a folder of its own, keyed by a digest of the sources,
  the flags, the compiler, torch and Python, so a venv moved to another CPU loads or builds the right one and never
  dies with an illegal instruction;
- MINIVLLM_CPU_KERNELS=off turns every kernel off (what a reader without a compiler gets), CXX picks the compiler;
- a compiler without OpenMP builds the same code without threads (at::parallel_for then runs its ranges in turn);
- "no compiler" (KernelUnavailable) and "the code does not compile" (KernelBuildError, with the compiler's own
  message) are told apart, and each kernel is built at most once per process: a failure is remembered;
- builds of one kernel by several processes wait on an flock, which the operating system releases when its holder
  dies (a Jupyter restart mid-build leaves no stale lock), and the library is moved into place whole.
"""

import functools
import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")

# Each level adds instructions to the one before; a kernel's `#if defined(__AVX2__)` ... picks its loop at compile
# time. "native" levels are chosen from what the CPU reports, never assumed (-march=native is not used).
ISA_FLAGS = {
    "portable": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd"),
}
ISA_FLAGS["avx512_vnni"] = ISA_FLAGS["avx512"] + ("-mavx512vnni",)
ISA_FLAGS["avx512_bf16"] = ISA_FLAGS["avx512_vnni"] + ("-mavx512bf16",)
ISA_NEEDS = {  # the /proc/cpuinfo flags each level needs, on top of the level before
    "portable": set(), "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
    "avx512_vnni": {"avx512_vnni"}, "avx512_bf16": {"avx512_bf16"},
}
ISA_LEVELS = tuple(ISA_FLAGS)


class KernelUnavailable(RuntimeError):
    """The C++ kernels cannot be built here (no compiler, or turned off): the engine falls back to torch."""


class KernelBuildError(KernelUnavailable):
    """The compiler ran and failed: its message is in the error's text."""


@functools.cache  # the CPU does not change under a running process
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags this CPU reports (Linux's /proc/cpuinfo); elsewhere, the level torch detected."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch

    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    flags = set()
    for level in ("avx2", "avx512"):
        if level.upper() in capability:
            flags |= ISA_NEEDS["avx2"] | ISA_NEEDS[level]
    return frozenset(flags)


def isa_level(flags: frozenset[str] | None = None) -> str:
    """The highest level whose instructions the CPU has, no higher than MINIVLLM_CPU_ISA (when set)."""
    cap = os.environ.get("MINIVLLM_CPU_ISA", "").strip() or ISA_LEVELS[-1]
    if cap not in ISA_LEVELS:
        raise ValueError(f"MINIVLLM_CPU_ISA={cap!r}: expected one of {', '.join(ISA_LEVELS)}")
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return "portable"  # the -m flags above are x86's; elsewhere the portable loops, compiled for the machine
    flags, level, needed = cpu_flags() if flags is None else flags, "portable", set()
    for candidate in ISA_LEVELS[1:ISA_LEVELS.index(cap) + 1]:
        needed |= ISA_NEEDS[candidate]
        if not needed <= flags:
            break
        level = candidate
    return level


def cpu_description() -> str:
    """This CPU's model name, its kernel level and whether it has AMX: what a hardware-specific number is about."""
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    amx = "with AMX" if "amx_tile" in cpu_flags() else "no AMX"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} logical CPUs ({isa_level()} kernels, {amx})"


def kernels_enabled() -> bool:
    setting = os.environ.get("MINIVLLM_CPU_KERNELS", "on").strip().lower()
    if setting not in ("on", "off"):
        raise ValueError(f"MINIVLLM_CPU_KERNELS={setting!r}: expected 'on' or 'off'")
    return setting == "on"


def compiler() -> str:
    return os.environ.get("CXX", "").strip() or "c++"


@functools.cache
def _compiler_version(path: str) -> list[str]:
    return subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout.splitlines()[:1]


def compiler_identity(cxx: str) -> str:
    """The compiler's path and first line of `--version`; KernelUnavailable when there is none to run."""
    path = shutil.which(cxx)
    if path is None:
        raise KernelUnavailable(f"no C++ compiler: {cxx!r} is not on PATH (set CXX, or install g++ or clang++)")
    try:
        version = _compiler_version(path)
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelUnavailable(f"the C++ compiler {path} does not run: {error}") from None
    return f"{path} {' '.join(version)}"


@functools.cache
def openmp_flags(cxx: str) -> tuple[str, ...]:
    """-fopenmp where the compiler compiles and links it (gcc; clang with libomp), else -fopenmp-simd (the
    `#pragma omp simd` hints without threads), else nothing."""
    def accepted(flag: str) -> bool:
        with tempfile.TemporaryDirectory() as folder:
            source = Path(folder, "probe.cpp")
            source.write_text("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
                              if flag == "-fopenmp" else "int main() { return 0; }\n")
            try:
                done = subprocess.run([cxx, flag, str(source), "-o", str(Path(folder, "probe"))],
                                      capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError):
                return False
            return done.returncode == 0

    return next(((flag,) for flag in ("-fopenmp", "-fopenmp-simd") if accepted(flag)), ())


def cache_root() -> Path:
    """MINIVLLM_KERNEL_CACHE, else this install's own folder beside its Python, else ~/.cache/minivllm/kernels."""
    for folder in (os.environ.get("MINIVLLM_KERNEL_CACHE"), Path(sys.prefix) / "minivllm_kernels",
                   Path.home() / ".cache" / "minivllm" / "kernels"):
        if folder:
            try:
                Path(folder).mkdir(parents=True, exist_ok=True)
            except OSError:
                continue
            if os.access(folder, os.W_OK):
                return Path(folder)
    raise KernelUnavailable("no writable folder for the compiled kernels (set MINIVLLM_KERNEL_CACHE)")


def compile_command(source: Path, isa: str, extra_flags: tuple[str, ...], module: str, output: Path) -> list[str]:
    """The one compiler call that builds `source` (a .cpp file; csrc's headers on its include path) into `output`,
    the Python module `module`."""
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    cxx = compiler()
    command = [cxx, "-O3", "-std=c++20", "-shared", "-fPIC", *ISA_FLAGS[isa], *openmp_flags(cxx), *extra_flags,
               f"-DTORCH_EXTENSION_NAME={module}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-I{CSRC}",
               *(f"-I{path}" for path in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
               str(source), "-o", str(output)]
    libraries = cpp_extension.library_paths()
    command += [*(f"-L{path}" for path in libraries), *(f"-Wl,-rpath,{path}" for path in libraries),
                "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    if sys.platform == "darwin":
        command += ["-undefined", "dynamic_lookup"]
    return command


def build_key(source: Path, isa: str, extra_flags: tuple[str, ...]) -> str:
    """A digest of everything the library depends on: its sources (the .cpp and csrc's headers), flags, compiler,
    torch and Python."""
    import torch

    digest = hashlib.sha256()
    for path in [Path(source), *sorted(CSRC.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    identity = [isa, *ISA_FLAGS[isa], *openmp_flags(compiler()), *extra_flags, compiler_identity(compiler()),
                torch.__version__, sys.version, platform.machine()]
    digest.update("\0".join(identity).encode())
    return digest.hexdigest()[:16]


LOCK_PATIENCE_S = 600.0  # how long to wait for another live process's build of the same kernel


def _locked(lock_path: Path):
    """An exclusive flock on `lock_path` (waiting for a live holder, named in a message), or None where the
    platform has no flock (the build then relies on its atomic rename alone)."""
    try:
        import fcntl
    except ImportError:
        return None
    handle = open(lock_path, "a+")
    started, told = time.monotonic(), False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if not told:
                handle.seek(0)
                print(f"minivllm: waiting for another build of {lock_path.parent.name} "
                      f"({handle.read().strip() or 'a process'})", file=sys.stderr)
                told = True
            if time.monotonic() - started > LOCK_PATIENCE_S:
                handle.close()
                raise KernelBuildError(f"{lock_path.parent.name}: another process held the build lock "
                                       f"{lock_path} for {LOCK_PATIENCE_S:.0f} s")
            time.sleep(0.5)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}")
    handle.flush()
    return handle


def _build(name: str, source: Path, isa: str, extra_flags: tuple[str, ...]) -> Path:
    if not source.is_file():
        raise ValueError(f"no kernel source {source}")
    key = build_key(source, isa, extra_flags)  # checks the compiler first: KernelUnavailable without one
    folder = cache_root() / f"{name}-{isa}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"minivllm_{name}_{isa}.so"
    if library.is_file():
        return library
    lock = _locked(folder / "build.lock")
    try:
        if library.is_file():  # built by the process we waited for
            return library
        partial = folder / f"{library.stem}.{os.getpid()}.tmp.so"
        command = compile_command(source, isa, extra_flags, library.stem, partial)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            errors = [line for line in done.stderr.splitlines() if "error" in line or "Error" in line]
            shown = "\n".join((errors or done.stderr.splitlines())[:20])
            raise KernelBuildError(f"{source} did not compile for {isa} with {command[0]}:\n"
                                   f"{shown}\n(the full command: {' '.join(command)})")
        os.replace(partial, library)
        return library
    finally:
        if lock is not None:
            lock.close()


_loaded: dict[tuple, object] = {}  # (name, isa, flags) -> the module, or the exception its build raised


def load_kernel(name: str, extra_flags: tuple[str, ...] = (), isa: str | None = None, source: Path | None = None):
    """csrc/<name>.cpp (or `source`, a file of your own that may include csrc's headers) as a Python module, built
    for `isa` (default: this CPU's level, capped by MINIVLLM_CPU_ISA) the first time; raises KernelUnavailable or
    KernelBuildError, the same one on every later call."""
    if not kernels_enabled():
        raise KernelUnavailable("the C++ kernels are turned off (MINIVLLM_CPU_KERNELS=off)")
    isa = isa_level() if isa is None else isa
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa={isa!r}: expected one of {', '.join(ISA_LEVELS)}")
    source = Path(source) if source is not None else CSRC / f"{name}.cpp"
    key = (name, str(source), isa, tuple(extra_flags))
    if key not in _loaded:
        try:
            library = _build(name, source, isa, tuple(extra_flags))
            spec = importlib.util.spec_from_file_location(library.stem, library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _loaded[key] = module
        except KernelUnavailable as error:
            _loaded[key] = error
    if isinstance(_loaded[key], Exception):
        raise _loaded[key]
    return _loaded[key]


def kernel_problem(load) -> str | None:
    """Why a kernel's `load()` gives no module here (no compiler, turned off, the compiler's message), or None."""
    try:
        load()
    except KernelUnavailable as error:
        return str(error)
    return None


_told: set[str] = set()


def kernel_available(load) -> bool:
    """Whether a kernel's `load()` gives a module here. Once per process, a kernel that did not build says why (a
    compile error with the compiler's message): a fallback never hides a bug silently."""
    problem = kernel_problem(load)
    if problem is not None and kernels_enabled() and problem not in _told:
        _told.add(problem)
        warnings.warn(f"{problem}\nminivllm falls back to torch for this kernel", RuntimeWarning, stacklevel=2)
    return problem is None


def source_region(name: str, region: str) -> str:
    """The lines of csrc/<name> between `// region: <region>` and `// endregion`, as the compiler reads them."""
    text = (CSRC / name).read_text()
    found = re.search(rf"^[ \t]*// region: {re.escape(region)}\n(.*?)^[ \t]*// endregion\n", text, re.S | re.M)
    if found is None:
        raise KeyError(f"no region {region!r} in {CSRC / name}")
    return found.group(1).rstrip("\n")
