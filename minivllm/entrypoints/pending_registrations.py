"""Temporary: the registration chapter 8b will make in its own notebook cell (see the team's api.md). Until that
cell exists, this plain module makes it, so that the package's `LLM` keeps chapter 8b's kernels as its "auto"
attention backend. It is deleted when the cell lands."""

from minivllm.attention.selector import attention_backend_class
from minivllm.entrypoints.llm import ATTENTION_SELECTORS

if attention_backend_class not in ATTENTION_SELECTORS:
    ATTENTION_SELECTORS.append(attention_backend_class)


# Temporary, until chapter 11's TensorParallelRunner.execute builds its batch with the runner's prepare_inputs
# (api.md section 6): the same execute, with its two lines that read the KV cache manager replaced.
from minivllm.distributed import engine as _tensor_parallel  # noqa: E402
from minivllm.distributed.executor import batch_message  # noqa: E402


def _execute(self, scheduler_output):
    if self.broken:
        raise RuntimeError(f"the tensor-parallel engine stopped after an earlier failure: {self.broken}")
    self.workers.check_alive()
    input_ids, positions, metadata = self.prepare_inputs(scheduler_output)
    try:
        self.workers.broadcast(batch_message(input_ids, positions, metadata, []))
        hidden = self.model(input_ids, positions, metadata)
        self.workers.check_alive()
    except Exception as error:
        self.broken = str(error)
        try:
            self.workers.check_alive()
        except RuntimeError as dead:
            self.broken = str(dead)
            raise dead from error
        raise
    return self.sample(scheduler_output.scheduled, hidden, metadata.query_start_loc)


if "kv_manager" in _tensor_parallel.TensorParallelRunner.execute.__code__.co_names:
    _tensor_parallel.TensorParallelRunner.execute = _execute
