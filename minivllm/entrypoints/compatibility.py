"""What composes with what: the one table of the feature pairs `LLM(...)` refuses, each with its reason.

`LLM` checks its keywords against it first, before any weight is read or any process started; chapter 13 prints
it; tests/test_composition.py runs every pair of features, and a pair that is not in the table must give the
tokens each feature gives alone, with every KV block back. Plain module: it names every chapter's keywords, so
that chapter 6's `LLM` can check them without importing a later chapter's code.
"""

import torch

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


# a feature: (the keywords that turn it on, whether they do, given LLM's keywords and the weights' dtype)
FEATURES = {
    "no prefix cache": ("enable_prefix_caching=False", lambda kw, dtype: kw.get("enable_prefix_caching") is False),
    "speculative decoding": ("speculative_config", lambda kw, dtype: kw.get("speculative_config") is not None),
    "tensor parallelism": ("tensor_parallel_size > 1", lambda kw, dtype: _positive_int(kw.get("tensor_parallel_size"))),
    "KV tier": ("kv_offloading_size", lambda kw, dtype: kw.get("kv_offloading_size") is not None),
    "file tier": ("kv_offloading_file_tier", lambda kw, dtype: kw.get("kv_offloading_file_tier") is not None),
    "KV events": ("kv_events_config", lambda kw, dtype: isinstance(kw.get("kv_events_config"), dict)
                  and kw["kv_events_config"].get("enable_kv_cache_events") is True),
    "int8 weights": ("quantization", lambda kw, dtype: kw.get("quantization") is not None),
    "16-bit weights": ("dtype bfloat16 or float16", lambda kw, dtype: dtype in SIXTEEN_BIT),
}

# every pair refused, and why; a pair not here composes
INCOMPATIBLE = {
    ("tensor parallelism", "KV tier"): "the tier's connector runs on rank 0 only and would copy rank 0's shard of "
                                       "each block, not the block",
    ("tensor parallelism", "int8 weights"): "chapter 8b's int8 layers replace nn.Linear, and a rank's shards are "
                                            "chapter 11's parallel layers: the ranks would keep fp32 weights",
    ("int8 weights", "16-bit weights"): "int8 weights run with fp32 activations on a CPU (chapter 8b): load "
                                        "the model in float32",
    ("no prefix cache", "KV events"): "KV events report the prefix cache's names for blocks; with the cache off "
                                      "there are none",
}

# a feature that needs another, and why
NEEDS = {"file tier": ("KV tier", "the file tier sits behind the CPU tier: give kv_offloading_size too")}


def features_on(keywords: dict, dtype: torch.dtype) -> list[str]:
    return [name for name, (_, on) in FEATURES.items() if on(keywords, dtype)]


def check_compatible(keywords: dict, dtype: torch.dtype) -> None:
    """ValueError naming the keywords of the first refused pair (or missing need) among those turned on."""
    on = features_on(keywords, dtype)
    for (a, b), reason in INCOMPATIBLE.items():
        if a in on and b in on:
            raise ValueError(f"{FEATURES[a][0]} ({a}) with {FEATURES[b][0]} ({b}) is refused: {reason}")
    for feature, (needed, reason) in NEEDS.items():
        if feature in on and needed not in on:
            raise ValueError(f"{FEATURES[feature][0]} ({feature}) needs {FEATURES[needed][0]}: {reason}")


def refused(a: str, b: str) -> bool:
    """Whether features a and b (with what each needs) include a refused pair."""
    with_needs = lambda feature: {feature} | ({NEEDS[feature][0]} if feature in NEEDS else set())  # noqa: E731
    return any((x, y) in INCOMPATIBLE or (y, x) in INCOMPATIBLE for x in with_needs(a) for y in with_needs(b))


def composition_table() -> str:
    """The table as markdown: every pair of features, refused or composed."""
    names = list(FEATURES)
    rows = ["| | " + " | ".join(names[1:]) + " |", "|---" * len(names) + "|"]
    for i, a in enumerate(names[:-1]):
        cells = ["" if j <= i else "refused" if refused(a, b) else "yes" for j, b in enumerate(names[1:], start=1)]
        rows.append(f"| **{a}** | " + " | ".join(cells) + " |")
    return "\n".join(rows)
