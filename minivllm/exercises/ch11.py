"""Chapter 11 exercises. The reader's sharding function fills the weights of every rank's shard of the embedded
model; the ranks run as threads of this process (`ThreadGroup`, the chapter's simulator), and their logits
and greedy tokens are checked against transformers."""

import copy

import torch
from torch import nn

from minivllm.exercises import close, exercise, expect

PROMPT_TOKENS = 12


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


def _split_cases(dim: int, what: str):
    def case(shape, world):
        def test(candidate):
            weight = torch.arange(float(torch.tensor(shape).prod())).reshape(shape)
            parts = [torch.as_tensor(candidate(weight.clone(), rank, world)) for rank in range(world)]
            for rank, part in enumerate(parts):
                want = list(shape)
                want[dim] //= world
                expect(list(part.shape) == want, f"{list(shape)}, rank {rank} of {world}: shape {list(part.shape)}, "
                       f"expected {want}")
            expect(torch.equal(torch.cat(parts, dim), weight),
                   f"{list(shape)}, {world} ranks: the shards put back together (dim {dim}) are not the {what}")
        return test
    return case


@exercise("11.shard_column")
def _shard_column():
    """shard_column(weight, rank, world_size): rank's share of the output features (weight rows; or a bias)."""
    def fill_for(shard_column):
        def fill(rank, world, full, layer):
            for parent, name in [(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj")] + \
                                [(layer.mlp, n) for n in ("gate_proj", "up_proj")]:
                source, target = getattr(full.self_attn if parent is layer.self_attn else full.mlp, name), \
                    getattr(parent, name)
                _put(target, "weight", shard_column(source.weight.data.clone(), rank, world), target.weight.shape)
        return fill

    case = _split_cases(0, "weight")
    return [("a [6, 4] weight, 2 ranks", case((6, 4), 2)), ("a [8, 3] weight, 4 ranks", case((8, 3), 4)),
            ("a bias of 6, 3 ranks", case((6,), 3)), *_model_cases(2, fill_for)]


@exercise("11.shard_row")
def _shard_row():
    """shard_row(weight, rank, world_size): rank's share of the input features (weight columns)."""
    def fill_for(shard_row):
        def fill(rank, world, full, layer):
            for source, target in ((full.self_attn.o_proj, layer.self_attn.o_proj),
                                   (full.mlp.down_proj, layer.mlp.down_proj)):
                _put(target, "weight", shard_row(source.weight.data.clone(), rank, world), target.weight.shape)
        return fill

    case = _split_cases(1, "weight")
    return [("a [4, 6] weight, 2 ranks", case((4, 6), 2)), ("a [3, 8] weight, 4 ranks", case((3, 8), 4)),
            *_model_cases(2, fill_for)]


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
