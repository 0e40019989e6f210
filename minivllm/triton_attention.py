import importlib.util
import os

import torch

from minivllm.paged import PagedAttention

# Triton compiles kernels for GPUs. Without a CUDA GPU its interpreter runs them on the CPU with numpy instead;
# triton reads TRITON_INTERPRET when a kernel is defined (@triton.jit), so it is set here, on import, before
# this package defines any kernel (minivllm.triton_kernels imports this module first).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NO_TRITON = "attention backend 'triton' needs the triton package: pip install triton (Linux only)"


def triton_available() -> bool:
    """Whether the Triton backend can run here: triton is installed (on Linux). Without a CUDA GPU its kernels
    run in the interpreter: correct, and very slow."""
    return importlib.util.find_spec("triton") is not None


class TritonPagedAttention(PagedAttention):
    """Chapter 5's paged backend with its attention done by the Triton kernels: the decode kernel when every
    sequence brings one token, the prefill kernel otherwise (it handles decodes mixed into a batch too)."""

    def __init__(self, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables):
        super().__init__(kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables)
        if not triton_available():
            raise ImportError(NO_TRITON)
        if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
            raise ValueError(f"block_tables is {block_tables.dtype} {tuple(block_tables.shape)}: expected int32 "
                             "[num_seqs, max_blocks]")
        num_seqs = block_tables.shape[0]
        if query_start_loc.shape != (num_seqs + 1,) or seq_lens.shape != (num_seqs,):
            raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} and seq_lens {tuple(seq_lens.shape)}: "
                             f"expected ({num_seqs + 1},) and ({num_seqs},) for {num_seqs} rows of block_tables")
        query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()  # once per step, not once per layer
        if slot_mapping.shape != (sum(query_lens),):
            raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}: expected ({sum(query_lens)},), "
                             "one slot per new token")
        self.max_query_len = max(query_lens)
        self.max_seq_len = int(seq_lens.max())

    def attend(self, layer, q, k, v):
        from minivllm.triton_kernels import check_paged_inputs, paged_decode_attention, paged_prefill_attention

        k_cache, v_cache = self.kv_cache.layer(layer)
        _, _, kv_heads, head_dim = k_cache.shape
        check_paged_inputs(q, k_cache, v_cache, self.block_tables, self.seq_lens)
        for name, t in (("k", k), ("v", v)):
            if t.shape != (q.shape[0], kv_heads, head_dim) or t.dtype != k_cache.dtype:
                raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}: expected {k_cache.dtype} "
                                 f"{(q.shape[0], kv_heads, head_dim)}")
        k_cache.view(-1, kv_heads, head_dim)[self.slot_mapping] = k
        v_cache.view(-1, kv_heads, head_dim)[self.slot_mapping] = v
        if self.max_query_len == 1:
            return paged_decode_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens, self.max_seq_len)
        return paged_prefill_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                                       self.max_query_len)


def attention_backend_class(attention_backend: str, device: torch.device) -> type[PagedAttention]:
    """The engine's `attention_backend` setting: "auto" is Triton on a CUDA GPU (when triton is installed) and
    the PyTorch reference elsewhere; "triton" on a CPU runs the kernels in the interpreter (slow, for tests)."""
    if attention_backend == "auto":
        use_triton = torch.device(device).type == "cuda" and triton_available()
        return TritonPagedAttention if use_triton else PagedAttention
    if attention_backend == "triton":
        if not triton_available():
            raise ImportError(NO_TRITON)
        return TritonPagedAttention
    if attention_backend == "torch":
        return PagedAttention
    raise ValueError(f"attention_backend = {attention_backend!r}: expected 'auto', 'triton' or 'torch'")
