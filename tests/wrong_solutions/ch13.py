"""Wrong answers to chapter 13's exercises."""


def lookup_claims_the_last_token(manager, request, first_block):  # the last-token rule forgotten
    found = []
    for block_hash in manager.block_hashes(request, request.num_tokens // manager.block_size)[first_block:]:
        kv = manager.store.lookup(block_hash)
        if kv is None:
            break
        found.append(kv)
    return found


def lookup_from_the_first_block(manager, request, first_block):  # the pool's hit counted again from the tier
    found = []
    for block_hash in manager.block_hashes(request, (request.num_tokens - 1) // manager.block_size):
        kv = manager.store.lookup(block_hash)
        if kv is None:
            break
        found.append(kv)
    return found


def lookup_skips_gaps(manager, request, first_block):  # keeps looking after the chain breaks
    hashes = manager.block_hashes(request, (request.num_tokens - 1) // manager.block_size)[first_block:]
    return [kv for kv in map(manager.store.lookup, hashes) if kv is not None]


def lookup_nothing(manager, request, first_block):
    return []


def offer_the_output_too(manager, request, end):  # offload_prompt_only forgotten
    offered, full = manager.num_offered.get(request.request_id, 0), end // manager.block_size
    table, hashes = manager.block_tables[request.request_id], manager.block_hashes(request, full)
    return [(table[i], hashes[i]) for i in range(offered, full)]


def offer_everything_again(manager, request, end):  # re-offers blocks already offered
    full = min(end, len(request.prompt_token_ids)) // manager.block_size
    table, hashes = manager.block_tables[request.request_id], manager.block_hashes(request, full)
    return [(table[i], hashes[i]) for i in range(full)]


def offer_one_block_short(manager, request, end):  # the block the step completes is left out
    offered = manager.num_offered.get(request.request_id, 0)
    full = max(offered, min(end, len(request.prompt_token_ids)) // manager.block_size - 1)
    table, hashes = manager.block_tables[request.request_id], manager.block_hashes(request, full)
    return [(table[i], hashes[i]) for i in range(offered, full)]


WRONG = {
    "13.tier_lookup": [lookup_claims_the_last_token, lookup_from_the_first_block, lookup_skips_gaps, lookup_nothing],
    "13.blocks_to_offer": [offer_the_output_too, offer_everything_again, offer_one_block_short],
}
RUN_THE_MODEL = {"13.tier_lookup", "13.blocks_to_offer"}
