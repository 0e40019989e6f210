"""Chapter 11 exercises. The reader's vocabulary-parallel embedding runs on ranks that are threads (`ThreadGroup`,
the chapter's simulator), then on every rank of a real LLM(tensor_parallel_size=2), against transformers. The
reader's fused-QKV sharding fills the weights of every rank's shard of the embedded model, on threads, and the
logits and greedy tokens are checked against transformers."""

import copy
import os

import torch
from torch import nn

from minivllm.exercises import case_random, close, exercise, expect

PROMPT_TOKENS = 12
START_METHOD_VARIABLES = ("VLLM_WORKER_MULTIPROC_METHOD", "MINIVLLM_WORKER_MULTIPROC_METHOD")


def _shards(world: int, fill):
    """world shards of the embedded model, their all-reduces through a ThreadGroup; fill(rank, world,
    full layer, sharded layer) puts the reader's weights in."""
    from minivllm.book.mechanism_checks import tiny_model
    from minivllm.distributed.parallel_state import ThreadGroup
    from minivllm.distributed.shard import shard_model

    full = tiny_model()[0]
    group = ThreadGroup(world)
    shards = []
    for rank in range(world):
        shard = shard_model(copy.deepcopy(full), rank, world, group.all_reduce_for(rank))
        for full_layer, layer in zip(full.model.layers, shard.model.layers):
            fill(rank, world, full_layer, layer)
        shards.append(shard)
    return group, shards


def _put(module, name: str, value, shape) -> None:
    value = torch.as_tensor(value)
    expect(tuple(value.shape) == tuple(shape), f"{name}: shard of shape {tuple(value.shape)}, expected {tuple(shape)}")
    setattr(module, name, nn.Parameter(value.contiguous(), requires_grad=False))


def _logits(group, shards, ids: list[int]) -> list[torch.Tensor]:
    from minivllm.attention.base import NoCacheAttention

    input_ids, positions, metadata = NoCacheAttention.for_sequences([ids])
    return group.run(lambda rank: shards[rank].compute_logits(shards[rank](input_ids, positions, metadata)))


def _prompt() -> list[int]:
    from minivllm.book.mechanism_checks import passage_prompts

    return passage_prompts([PROMPT_TOKENS])[0]


def _model_cases(world: int, fill_for):
    """The end-to-end checks: every rank's logits equal transformers', and 12 greedy tokens equal its."""
    def logits_match(candidate):
        from minivllm.book.mechanism_checks import tiny_model

        group, shards = _shards(world, fill_for(candidate))
        ids = _prompt()
        with torch.no_grad():
            want = tiny_model()[2](torch.tensor([ids])).logits[0]
        for rank, got in enumerate(_logits(group, shards, ids)):
            close(got, want, f"rank {rank}'s logits, {world} ranks", atol=1e-4, rtol=1e-4)

    def greedy_matches(candidate):
        from minivllm.book.mechanism_checks import divergence, greedy_reference

        group, shards = _shards(world, fill_for(candidate))
        ids = _prompt()
        for _ in range(PROMPT_TOKENS):
            logits = _logits(group, shards, ids)
            ids.append(int(logits[0][-1].argmax()))
        where = divergence(ids[PROMPT_TOKENS:], greedy_reference(_prompt(), PROMPT_TOKENS))
        expect(where is None, f"{world} ranks: greedy tokens part from transformers' at {where}")

    return [(f"the embedded model on {world} ranks (threads): logits equal transformers'", logits_match),
            (f"the embedded model on {world} ranks: {PROMPT_TOKENS} greedy tokens equal transformers'",
             greedy_matches)]


def _thread_ranks(candidate, embedding: nn.Embedding, world: int):
    """The reader's module on `world` ranks that are threads (the chapter's ThreadGroup), each from a copy."""
    from minivllm.distributed.parallel_state import ThreadGroup

    group = ThreadGroup(world, timeout_s=10.0)
    modules = [candidate(copy.deepcopy(embedding), rank, world, group.all_reduce_for(rank)) for rank in range(world)]
    return group, modules


def _held(module) -> int:
    return sum(t.numel() for t in [*module.parameters(), *module.buffers()])


def _embedding_cases(vocab: int, hidden: int, world: int, stream: str):
    """Every rank's output equals the whole table's rows, bit for bit, on ids that include each range's edges;
    every rank holds only its vocab / world rows."""
    def test(candidate):
        embedding = nn.Embedding(vocab, hidden)
        with torch.no_grad():
            embedding.weight.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(vocab)))
        group, modules = _thread_ranks(candidate, embedding, world)
        part = vocab // world
        for rank, module in enumerate(modules):
            expect(_held(module) <= part * hidden, f"vocabulary {vocab}, rank {rank} of {world}: holds "
                   f"{_held(module)} numbers, but its range is {part} rows of {hidden}")
        edges = sorted({i for r in range(world) for i in (r * part, r * part + part - 1)})
        rng = case_random(stream)
        ids = torch.tensor(edges + [rng.randrange(vocab) for _ in range(9)] + edges[::-1])
        with torch.no_grad():
            outs = group.run(lambda rank: torch.as_tensor(modules[rank](ids.clone())))
            want = embedding(ids)
        for rank, got in enumerate(outs):
            expect(tuple(got.shape) == tuple(want.shape), f"rank {rank}: output of shape {tuple(got.shape)}, "
                   f"expected {tuple(want.shape)}")
            wrong = (got != want).any(-1).nonzero()
            expect(not len(wrong), f"vocabulary {vocab} on {world} ranks: rank {rank}'s row for token id "
                   f"{int(ids[wrong[0]]) if len(wrong) else 0} is not that token's embedding "
                   f"(ranges of {part} ids: rank r holds r*{part} .. r*{part}+{part - 1})")
    return test


def _engine_case(candidate):
    """LLM(tensor_parallel_size=2): every rank, the driver and the worker process, embeds with the reader's
    module in place of its whole table; greedy tokens against transformers."""
    from minivllm import LLM, SamplingParams
    from minivllm.book.mechanism_checks import divergence, greedy_reference, passage_prompts
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.distributed.parallel_state import tensor_model_parallel_all_reduce

    reads_shard = LLMEngine.load_shard

    def load_with_reader_embedding(model, dtype, device, rank, world_size):
        lm = reads_shard(model, dtype, device, rank, world_size)
        lm.model.embed_tokens = candidate(lm.model.embed_tokens, rank, world_size, tensor_model_parallel_all_reduce)
        return lm

    prompts = passage_prompts([PROMPT_TOKENS, PROMPT_TOKENS + 5])
    saved = {name: os.environ.get(name) for name in START_METHOD_VARIABLES}
    os.environ.update(dict.fromkeys(saved, "fork"))  # the worker inherits the reader's class: a notebook's has no name
    LLMEngine.load_shard = staticmethod(load_with_reader_embedding)
    try:
        llm = LLM(device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
        try:
            greedy = SamplingParams(temperature=0, max_tokens=PROMPT_TOKENS, ignore_eos=True)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        finally:
            llm.shutdown()
    finally:
        LLMEngine.load_shard = staticmethod(reads_shard)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    for prompt, output in zip(prompts, outputs):
        where = divergence(list(output.outputs[0].token_ids), greedy_reference(prompt, PROMPT_TOKENS))
        expect(where is None, f"TP=2 with your embedding on both ranks: greedy tokens part from transformers' at {where}")


@exercise("11.vocab_parallel_embedding")
def _vocab_parallel_embedding():
    """VocabParallelEmbedding(embedding, rank, world_size, all_reduce): rank keeps only its range of the vocabulary
    (rows r * V / world .. (r + 1) * V / world - 1); forward(input_ids) looks up the ids in its range, gives zero
    rows for the others, and all-reduces, so that every rank ends with every token's embedding."""
    return [("vocabulary 10 on 2 ranks: the ids at each range's edges", _embedding_cases(10, 3, 2, "11.vpe/2")),
            ("vocabulary 12 on 4 ranks", _embedding_cases(12, 2, 4, "11.vpe/4")),
            ("the embedded model's vocabulary (2,048) on 2 ranks", _embedding_cases(2048, 8, 2, "11.vpe/model")),
            ("inside LLM(tensor_parallel_size=2): greedy tokens equal transformers'", _engine_case)]


def _qkv_reference(weight, num_heads, num_kv_heads, head_dim, rank, world_size):
    q, k, v = weight.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim])
    return torch.cat([part.chunk(world_size, 0)[rank] for part in (q, k, v)])


@exercise("11.shard_qkv")
def _shard_qkv():
    """shard_qkv(qkv_weight, num_heads, num_kv_heads, head_dim, rank, world_size): rank's rows of a fused
    [q; k; v] projection, laid out [its q heads; its k heads; its v heads] (vLLM's QKVParallelLinear)."""
    def fill_for(shard_qkv):
        def fill(rank, world, full, layer):
            a, c = full.self_attn, layer.self_attn
            fused = torch.cat([a.q_proj.weight.data, a.k_proj.weight.data, a.v_proj.weight.data])
            part = torch.as_tensor(shard_qkv(fused.clone(), a.num_heads, a.num_kv_heads, a.head_dim, rank, world))
            sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
            expect(part.shape[0] == sum(sizes), f"rank {rank} of {world}: {part.shape[0]} rows, expected {sum(sizes)} "
                   f"({c.num_heads} q heads + 2 x {c.num_kv_heads} kv heads of {c.head_dim})")
            for name, piece in zip(("q_proj", "k_proj", "v_proj"), part.split(sizes)):
                _put(getattr(c, name), "weight", piece, getattr(c, name).weight.shape)
        return fill

    def case(heads, kv_heads, head_dim, world):
        def test(shard_qkv):
            rows = (heads + 2 * kv_heads) * head_dim
            weight = torch.arange(rows * 3.0).reshape(rows, 3)
            for rank in range(world):
                got = torch.as_tensor(shard_qkv(weight.clone(), heads, kv_heads, head_dim, rank, world))
                want = _qkv_reference(weight, heads, kv_heads, head_dim, rank, world)
                expect(got.shape == want.shape, f"rank {rank}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
                wrong = (got != want).any(-1).nonzero()
                expect(not len(wrong), f"{heads} q / {kv_heads} kv heads of {head_dim}, rank {rank} of {world}: row "
                       f"{int(wrong[0]) if len(wrong) else 0} is not the right one (rows are [its q; its k; its v])")
        return test

    return [("4 q heads, 2 kv heads of 2, 2 ranks", case(4, 2, 2, 2)),
            ("8 q heads, 4 kv heads of 1, 4 ranks", case(8, 4, 1, 4)),
            ("multi-head (kv heads = q heads), 2 ranks", case(2, 2, 3, 2)),
            *_model_cases(2, fill_for), *_model_cases(4, fill_for)[:1]]
