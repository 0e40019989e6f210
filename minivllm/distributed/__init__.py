"""Chapter 11: tensor parallelism over torch.distributed (parallel_state, layers, shard, executor).

Importing this package starts nothing and initialises no process group: `TensorParallelEngine` does, when an
`LLM(..., tensor_parallel_size=N)` is built."""
