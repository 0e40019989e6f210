"""The checks behind loading a checkpoint folder (chapter 1's loader, chapter 11's shards): plumbing, not taught.
A checkpoint folder gets the scrutiny a GGUF file gets (minivllm/model/gguf_checks.py), before any weight is
allocated or read:

- `weight_files`: the files `model.safetensors.index.json` lists are plain file names in the folder (an index
  naming `../x`, `/etc/x` or `sub/x` is refused: it would read weights from anywhere on the disk), and the index
  is a JSON object of bounded size with a `weight_map` of names to names;
- `check_tensor_shapes`: every tensor the model takes has, in the files' headers (read without their data), the
  shape the config.json gives it, and none is missing. A wrong shape would be broadcast by `copy_` silently,
  and config.json dimensions larger than the files would be allocated before anything was read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from minivllm.config import ModelConfig
from minivllm.model.decoder import CausalLM

INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # a 1,000-shard model's index is a few MB


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index lists, or else every *.safetensors in the folder."""
    index = folder / INDEX
    if index.exists():
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise ValueError(f"{index}: {index.stat().st_size} bytes, more than an index of weights needs")
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise ValueError(f"{index}: not a JSON object with a weight_map") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise ValueError(f"{index}: weight_map must map tensor names to file names")
        names = sorted(set(weight_map.values()))
        for name in names:
            if Path(name).name != name or name in (".", "..") or not name.endswith(".safetensors"):
                raise ValueError(f"{INDEX} lists {name[:200]!r}: a weights file must be a file of the checkpoint "
                                 f"folder, named without a path (and ending in .safetensors)")
        files = [folder / name for name in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    for file in files:
        if not file.exists():
            raise FileNotFoundError(f"weights file {file} is missing (listed in {index.name})")
    return files


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, from a model built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in CausalLM(config).named_parameters()}


def check_tensor_shapes(files: list[Path], config: ModelConfig, folder: Path) -> None:
    """ValueError naming the first tensor whose stored shape differs from the model's, or the missing ones."""
    expected, found = expected_shapes(config), set()
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:  # the header only
                for name in f.keys():
                    if name not in expected:
                        continue
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != expected[name]:
                        raise ValueError(f"weights file {file.name}: {name} has shape {list(shape)}, but config.json "
                                         f"makes it {list(expected[name])}")
                    found.add(name)
        except (SafetensorError, OSError) as error:
            raise ValueError(f"weights file {file} cannot be read: {error}") from None
    missing = set(expected) - found - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"weights missing from {folder}: {sorted(missing)[:5]}")
