"""Where an engine run spends its time, by kind of work: chapter 8b's breakdown per workload and backend, and
chapter 9's look at the gather that verification pays.

Python's profiler records the time spent inside each function; the functions that do the work of a step
are few, so their own times, summed, split the run: the linear layers, the reference backend's gather,
PyTorch's attention, the C++ decode kernel, and everything else (the profiler's overhead included).
The run is timed on one thread, by that thread's CPU time: on a machine shared with other work, wall-clock
time also counts the moments the process waits for a core, and a call split over threads waits for the slowest.
"""

import cProfile
import pstats
import re
import time

import torch

PARTS = {"linear layers": ("linear",), "gather (index_select)": ("index_select",),
         "attention (SDPA)": ("scaled_dot_product_attention",), "C++ decode kernel": ("paged_decode",)}


def time_breakdown(llm, prompts, params) -> dict[str, float]:
    """CPU seconds per part for one `llm.generate(prompts, params)` on one thread, after a short warm-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every operation, the C++ kernel's included, then runs on the profiled thread
    try:
        llm.generate(prompts[:1], params, use_tqdm=False)
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        llm.generate(prompts, params, use_tqdm=False)
        profiler.disable()
    finally:
        torch.set_num_threads(threads)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own time, cumulative, callers)
    total = max(cumulative for _, _, _, cumulative, _ in stats.values())
    parts = {part: sum(own for (_, _, name), (_, _, own, _, _) in stats.items()
                       if any(re.search(rf"[ .']{n}[>']", name) for n in names))  # "<built-in method torch._C._nn.linear>"
             for part, names in PARTS.items()}
    parts["everything else"] = total - sum(parts.values())
    return parts
