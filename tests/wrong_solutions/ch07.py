"""Wrong answers to chapter 7's exercises."""

from minivllm.core.kv_cache_utils import SEED_HASH, block_hashes, hash_block


def shared_whole_match(a, b, block_size):  # the last-token rule forgotten
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(same // block_size, len(a) // block_size) * block_size


def shared_tokens_not_blocks(a, b, block_size):
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(same, len(b) - 1)


def shared_rounds_up(a, b, block_size):  # a block that matches only in part counted as shared
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(-(-same // block_size), (len(b) - 1) // block_size) * block_size


def chain_imports_the_answer(token_ids, block_size, salt=None):
    return block_hashes(token_ids, block_size, salt)


def chain_independent_blocks(token_ids, block_size, salt=None):
    return [hash_block(SEED_HASH, token_ids[k * block_size:(k + 1) * block_size], (salt,) if salt is not None else ())
            for k in range(len(token_ids) // block_size)]


def chain_salt_everywhere(token_ids, block_size, salt=None):
    hashes, parent = [], SEED_HASH
    for k in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[k * block_size:(k + 1) * block_size], (salt,) if salt is not None else ())
        hashes.append(parent)
    return hashes


def chain_hashes_partial_block(token_ids, block_size, salt=None):
    hashes, parent = [], SEED_HASH
    for k in range(-(-len(token_ids) // block_size)):
        extra = (salt,) if k == 0 and salt is not None else ()
        parent = hash_block(parent, token_ids[k * block_size:(k + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def chain_falsy_salt_ignored(token_ids, block_size, salt=None):
    hashes, parent = [], SEED_HASH
    for k in range(len(token_ids) // block_size):
        extra = (salt,) if k == 0 and salt else ()
        parent = hash_block(parent, token_ids[k * block_size:(k + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def computed_blocks_one_short(manager, request):  # off by one block: recomputes a cached block
    hit = []
    for block_hash in manager.block_hashes(request, max(0, (request.num_tokens - 1) // manager.block_size - 1)):
        block_id = manager.pool.cached.get(block_hash)
        if block_id is None:
            break
        hit.append(block_id)
    return hit, len(hit) * manager.block_size


def computed_blocks_skips_gaps(manager, request):  # keeps looking after the chain breaks
    hit = [manager.pool.cached[h] for h in manager.block_hashes(request, (request.num_tokens - 1) // manager.block_size)
           if h in manager.pool.cached]
    return hit, len(hit) * manager.block_size


def computed_blocks_none(manager, request):
    return [], 0


def predict_characters(text_a, text_b, tokenizer, block_size):  # characters counted instead of tokens
    d = next((i for i, (x, y) in enumerate(zip(text_a, text_b)) if x != y), min(len(text_a), len(text_b)))
    return block_size * min(d // block_size, len(text_a) // block_size, (len(text_b) - 1) // block_size)


def predict_no_last_token_rule(text_a, text_b, tokenizer, block_size):
    a, b = tokenizer(text_a).input_ids, tokenizer(text_b).input_ids
    d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return block_size * min(d // block_size, len(a) // block_size)


WRONG = {
    "07.shared_blocks": [shared_whole_match, shared_tokens_not_blocks, shared_rounds_up],
    "07.chain": [chain_imports_the_answer, chain_independent_blocks, chain_salt_everywhere,
                 chain_hashes_partial_block, chain_falsy_salt_ignored],
    "07.computed_blocks": [computed_blocks_one_short, computed_blocks_skips_gaps, computed_blocks_none],
    "07.predict_cached": [predict_characters, predict_no_last_token_rule],
}
