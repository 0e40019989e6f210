"""Beyond one process: tensor parallelism over torch.distributed (chapter 11: parallel_state, layers, shard,
executor; the engine's own start_workers) and, across replicas, KV events and the prefix-aware router (chapter 12: kv_events, router).

Importing this package starts nothing and initialises no process group: `LLMEngine.start_workers` does, when an
`LLM(..., tensor_parallel_size=N)` is built."""
