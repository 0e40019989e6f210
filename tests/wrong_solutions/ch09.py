"""Wrong answers to chapter 9's exercises."""

import torch

from minivllm.spec_decode.ngram_proposer import NgramProposer


def expected_no_bonus(num_drafts, num_accepted_tokens_per_pos):  # the target's own token forgotten
    return sum(num_accepted_tokens_per_pos) / num_drafts if num_drafts else 1.0


def expected_per_draft_token(num_drafts, num_accepted_tokens_per_pos):  # divided by every guess, not every round
    k = len(num_accepted_tokens_per_pos)
    return 1 + sum(num_accepted_tokens_per_pos) / (num_drafts * k) if num_drafts else 1.0


def expected_from_the_formula(num_drafts, num_accepted_tokens_per_pos):  # E(alpha, k), alpha measured
    k = len(num_accepted_tokens_per_pos)
    if not num_drafts:
        return 1.0
    alpha = sum(num_accepted_tokens_per_pos) / (num_drafts * k)
    return k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_first_position_only(num_drafts, num_accepted_tokens_per_pos):  # alpha from the first guesses, k times
    if not num_drafts:
        return 1.0
    return 1 + len(num_accepted_tokens_per_pos) * num_accepted_tokens_per_pos[0] / num_drafts


def ngram_imports_the_answer(token_ids, k, prompt_lookup_max, prompt_lookup_min):
    return NgramProposer(prompt_lookup_max, prompt_lookup_min).lookup(token_ids, k)


def ngram_earliest_match(token_ids, k, prompt_lookup_max, prompt_lookup_min):
    for n in range(min(prompt_lookup_max, len(token_ids) - 1), prompt_lookup_min - 1, -1):
        tail = token_ids[-n:]
        for start in range(len(token_ids) - n):
            if token_ids[start:start + n] == tail:
                return token_ids[start + n:start + n + k]
    return []


def ngram_shortest_first(token_ids, k, prompt_lookup_max, prompt_lookup_min):
    for n in range(prompt_lookup_min, min(prompt_lookup_max, len(token_ids) - 1) + 1):
        tail = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):
            if token_ids[start:start + n] == tail:
                return token_ids[start + n:start + n + k]
    return []


def ngram_uncut(token_ids, k, prompt_lookup_max, prompt_lookup_min):
    for n in range(min(prompt_lookup_max, len(token_ids) - 1), prompt_lookup_min - 1, -1):
        tail = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):
            if token_ids[start:start + n] == tail:
                return token_ids[start + n:]
    return []


def verify_greedy_no_bonus(target_argmax, draft_tokens):
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_argmax[accepted]:
        accepted += 1
    return draft_tokens[:accepted] + ([target_argmax[accepted]] if accepted < len(draft_tokens) else [])


def verify_greedy_counts_later_matches(target_argmax, draft_tokens):
    out = [d for d, t in zip(draft_tokens, target_argmax) if d == t]
    return out + [target_argmax[len(out)]]


def verify_sampled_always_accept(target_probs, draft_tokens, draft_probs, generator):
    return list(draft_tokens) + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


def verify_sampled_no_residual(target_probs, draft_tokens, draft_probs, generator):
    out = []
    for j, token in enumerate(draft_tokens):
        q = 1.0 if draft_probs is None else float(draft_probs[j, token])
        if torch.rand((), generator=generator) < target_probs[j, token] / q:
            out.append(token)
            continue
        return out + [int(torch.multinomial(target_probs[j], 1, generator=generator))]  # p, not (p - q)+
    return out + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


WRONG = {
    "09.expected_tokens": [expected_no_bonus, expected_per_draft_token, expected_from_the_formula,
                           expected_first_position_only],
    "09.ngram_lookup": [ngram_imports_the_answer, ngram_earliest_match, ngram_shortest_first, ngram_uncut],
    "09.verify_greedy": [verify_greedy_no_bonus, verify_greedy_counts_later_matches],
    "09.verify_sampled": [verify_sampled_always_accept, verify_sampled_no_residual],
}

RUN_THE_MODEL = {"09.expected_tokens"}
