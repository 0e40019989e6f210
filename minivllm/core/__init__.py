"""The engine's bookkeeping, no tensors: requests, the block pool, the KV cache manager (block tables, the
prefix cache's hash chain) and the scheduler."""
