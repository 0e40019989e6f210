"""Check the book's vLLM citations against one vLLM release: every `vllm/...` path the notebooks and book/*.md
name must exist in that release, and every class or function cited beside a path must be defined there.

    python -m minivllm.tools.vllm_cites                   # pip download vllm==PIN --no-deps (needs the network)
    python -m minivllm.tools.vllm_cites --wheel vllm-0.33.0-....whl
    python -m minivllm.tools.vllm_cites --source /tmp/vllm033/src   # a folder holding vllm/ (or vllm/ itself)

A name counts as cited beside a path when the text writes it the way the book's tables and prose do:
`` `Name` (`vllm/x.py`) ``, `` `Name` in `vllm/x.py` `` or `` `vllm/x.py` (`Name`, `other_name`) ``; a dotted
`Class.method` needs both parts defined in the file (for a cited folder: in any file below it). A path followed
by an older version, `` `vllm/attention/layer.py` in v0.11 `` or `` (v0.11) ``, is history, not checked. Exit
status 1 lists what is missing, one line per citation, with the file and cell that makes it. Not part of
`make test`.
"""

import argparse
import builtins
import json
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

VLLM_PIN = "0.33.0"
ROOT = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "minivllm" / "vllm-cites"

PATH = r"(?<![\w/.-])vllm/[\w/.-]*[\w/]"  # minivllm/... and github.com/vllm-project/vllm/... are not cites
NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?"
NAMES = rf"`{NAME}`(?:(?:,\s*|,?\s+and\s+|\s+or\s+)`{NAME}`)*"
NAME_THEN_PATH = re.compile(rf"({NAMES})\s+(?:\(|in\s+|from\s+)`({PATH})`")
PATH_THEN_NAMES = re.compile(rf"`({PATH})`\s*\(({NAMES})\)")
HISTORICAL = re.compile(rf"`{PATH}`(?=\s*(?:\(|in\s+)v\d+\.\d+)")  # `vllm/x.py` in v0.11, `vllm/x.py` (v0.11)
TABLE_PIN = re.compile(r"\|\s*vLLM v?(\d+\.\d+\.\d+)\s*\|")


@dataclass(frozen=True)
class Citation:
    where: str  # file and cell
    path: str
    name: str | None = None
    anywhere: bool = False  # a name in a table cell that cites a path, not written beside it: in the release


def book_texts(root: Path):
    """(where, text) for every notebook cell (markdown and code) and every book/*.md file."""
    for notebook in sorted((root / "notebooks").rglob("*.ipynb")):
        if ".ipynb_checkpoints" in notebook.parts:
            continue
        for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
            yield f"{notebook.relative_to(root)} [{index}]", "".join(cell["source"])
    for page in sorted((root / "book").glob("*.md")):
        yield str(page.relative_to(root)), page.read_text()


def citations(where: str, text: str) -> list[Citation]:
    text = HISTORICAL.sub("", text)  # where a file was in an older release is history, not a cite
    found = {Citation(where, path) for path in re.findall(PATH, text)}
    for names, path in NAME_THEN_PATH.findall(text):
        found |= {Citation(where, path, name) for name in re.findall(rf"`({NAME})`", names)}
    for path, names in PATH_THEN_NAMES.findall(text):
        found |= {Citation(where, path, name) for name in re.findall(rf"`({NAME})`", names)}
    beside = {c.name for c in found}
    for row in (line for line in text.splitlines() if line.lstrip().startswith("|")):
        for cell in row.split("|"):
            paths = re.findall(PATH, cell)
            found |= {Citation(where, paths[0], name, anywhere=True) for name in re.findall(rf"`({NAME})`", cell)
                      if paths and name not in beside}
    return sorted(found, key=lambda c: (c.path, c.name or "", c.anywhere))


def stale_pins(where: str, text: str, pin: str) -> list[str]:
    """The "In vLLM" tables' header pins that are not the book's pin."""
    return [f"{where}: table pinned to vLLM {version}, the book's pin is {pin}"
            for version in TABLE_PIN.findall(text) if version != pin]


DEFINITION = re.compile(r"^\s*(?:(?:async\s+)?def|class)\s+(\w+)|^\s*(?:self\.)?(\w+)\s*(?::[^=\n]*)?=(?!=)"
                        r"|^\s*(\w+)\s*:", re.M)
LITERAL = re.compile(r"[\"'](\w+)[\"']")
IMPORTED = re.compile(r"^\s*(?:from\s+[\w.]+\s+)?import\s+\(?([\w\s,.]+)\)?", re.M)


def definitions(files: list[Path], imported: bool = False) -> set[str]:
    """The names the files define: classes, functions and methods, assigned names and attributes, fields;
    with `imported`, also the names they import."""
    names = set()
    for file in files:
        text = file.read_text(errors="replace")
        names |= {next(group for group in match.groups() if group) for match in DEFINITION.finditer(text)}
        if imported:  # a library's name the release uses (tokenizers' DecodeStream, prometheus_client), a value
            names |= {word for match in IMPORTED.findall(text) for word in re.findall(r"\w+", match)}
            names |= set(LITERAL.findall(text))  # a string value the release gives a name to: "fcfs"
            names |= set(re.findall(r"\.([A-Z]\w+)", text))  # a class used by attribute: decoders.DecodeStream
    return names


def defined(name: str, names: set[str]) -> bool:
    """Every part of a dotted name (`Class.method`, `function()`) is among the defined names, or the name is
    Python's own (a builtin such as GeneratorExit, or a standard module's: asyncio.CancelledError)."""
    parts = name.removesuffix("()").split(".")
    return all(part in names for part in parts) or parts[0] in sys.stdlib_module_names or hasattr(builtins, parts[0])


def problems(citations_found: list[Citation], source_root: Path, ours: set[str] = frozenset()) -> list[str]:
    """What is missing from the release. A name a table cell mentions without a path beside it may be the book's
    own (`ours`, what minivllm defines): it is checked only when minivllm does not define it."""
    out, reported, per_path = [], set(), {}
    release = None
    for cite in citations_found:
        target = source_root / cite.path
        if not target.exists():
            if (cite.where, cite.path) not in reported:
                out.append(f"{cite.where}: {cite.path} does not exist")
                reported.add((cite.where, cite.path))
            continue
        if cite.name is None:
            continue
        if cite.name.endswith(".py"):  # a sibling file written by its name: `llama.py` beside `vllm/.../qwen3.py`
            folder = target if target.is_dir() else target.parent
            if cite.anywhere and next((source_root / "vllm").rglob(cite.name), None) is None:
                out.append(f"{cite.where}: {cite.name} (cited with {cite.path}) exists nowhere in the release")
            elif not cite.anywhere and not (folder / cite.name).exists():
                out.append(f"{cite.where}: {cite.name} (beside {cite.path}) does not exist in "
                           f"{folder.relative_to(source_root)}")
            continue
        if cite.anywhere and cite.name in ours:
            continue
        if cite.anywhere:
            release = release or definitions(sorted((source_root / "vllm").rglob("*.py")), imported=True)
            if not defined(cite.name, release):
                out.append(f"{cite.where}: {cite.name} (cited with {cite.path}) is defined nowhere in the release")
            continue
        if cite.path not in per_path:
            per_path[cite.path] = definitions([target] if target.is_file() else sorted(target.rglob("*.py")))
        if not defined(cite.name, per_path[cite.path]):
            out.append(f"{cite.where}: {cite.name} is not defined in {cite.path}")
    return out


def source_from_wheel(wheel: Path, into: Path) -> Path:
    """The wheel's vllm/ tree extracted once into `into`: its text files whole, every other file (compiled
    extensions, some hundreds of MB) as an empty stand-in, so that a cite of it is found without the bytes."""
    marker = into / ".complete"
    if not marker.exists():
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if not member.startswith("vllm/") or member.endswith("/"):
                    continue
                if member.endswith((".py", ".pyi", ".json", ".txt")):
                    archive.extract(member, into)
                else:
                    (into / member).parent.mkdir(parents=True, exist_ok=True)
                    (into / member).touch()
        marker.write_text(wheel.name)
    return into


def downloaded_wheel(pin: str, cache: Path) -> Path:
    wheels = sorted(cache.glob(f"vllm-{pin}-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", f"vllm=={pin}", "--no-deps", "--only-binary", ":all:",
                   "-d", str(cache)]
        if subprocess.run(command).returncode != 0:
            raise SystemExit(f"pip download vllm=={pin} failed; pass --wheel PATH or --source DIR instead")
        wheels = sorted(cache.glob(f"vllm-{pin}-*.whl"))
        if not wheels:
            raise SystemExit(f"pip download left no vllm-{pin}-*.whl in {cache}")
    return wheels[0]


def resolve_source(args) -> Path:
    if args.source:
        source = Path(args.source)
        root = source.parent if source.name == "vllm" else source
        if not (root / "vllm" / "__init__.py").exists():
            raise SystemExit(f"--source {source}: no vllm/__init__.py there (expected a folder holding vllm/)")
        return root
    wheel = Path(args.wheel) if args.wheel else downloaded_wheel(args.pin, Path(args.cache))
    if not wheel.is_file():
        raise SystemExit(f"--wheel {wheel}: no such file")
    return source_from_wheel(wheel, Path(args.cache) / wheel.stem)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", default=VLLM_PIN, help=f"the vLLM release the book cites (default {VLLM_PIN})")
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--wheel", help="a downloaded vllm wheel, instead of pip download")
    given.add_argument("--source", help="an extracted vLLM source tree (a folder holding vllm/)")
    parser.add_argument("--cache", default=str(CACHE), help="where downloads and extractions are kept")
    parser.add_argument("--root", default=str(ROOT), help="the project (holding notebooks/ and book/)")
    args = parser.parse_args(argv)
    source_root = resolve_source(args)
    found, pins = [], []
    for where, text in book_texts(Path(args.root)):
        found += citations(where, text)
        pins += stale_pins(where, text, args.pin)
    ours = definitions(sorted((Path(args.root) / "minivllm").rglob("*.py")))
    missing = problems(found, source_root, ours) + pins
    for line in missing:
        print(line)
    paths = {c.path for c in found}
    names = sum(c.name is not None for c in found)
    verdict = "all present" if not missing else f"{len(missing)} problem(s)"
    print(f"vLLM {args.pin}: {len(paths)} cited paths, {names} cited names: {verdict}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
