"""Chapter 11's measurement harness (book-only plumbing): the time of one all-reduce between processes."""

import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.distributed.parallel_state import destroy_tensor_parallel, free_port, init_tensor_parallel


def _all_reduce_loop(rank: int, world_size: int, port: int, shapes, repeats: int, results) -> None:
    torch.set_num_threads(1)
    init_tensor_parallel(rank, world_size, port, torch.device("cpu"), timeout_s=30.0)
    try:
        timings = {}
        for shape in shapes:
            x = torch.randn(shape)
            for _ in range(5):  # warm-up: connections, buffers
                dist.all_reduce(x)
            samples = []
            for _ in range(5):  # five rounds of back-to-back all-reduces, as a forward pass issues them
                dist.barrier()
                start = time.perf_counter()
                for _ in range(repeats):
                    dist.all_reduce(x)
                samples.append((time.perf_counter() - start) / repeats)
            timings[tuple(shape)] = min(samples) * 1e6  # the best round: other programs' noise counts least
        if rank == 0:
            results.put(timings)
    finally:
        destroy_tensor_parallel()


def all_reduce_microseconds(shapes, world_size: int = 2, repeats: int = 20, timeout_s: float = 60.0) -> dict:
    """µs of one fp32 gloo all-reduce of each shape (the best of five rounds of back-to-back calls), between world_size fresh processes on this machine
    (none of them this one, so that no process group is left here)."""
    ctx = mp.get_context("spawn")
    port, results = free_port(), ctx.Queue()
    processes = [ctx.Process(target=_all_reduce_loop, args=(r, world_size, port, list(shapes), repeats, results),
                             daemon=True) for r in range(world_size)]
    for process in processes:
        process.start()
    try:
        return results.get(timeout=timeout_s)
    finally:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
