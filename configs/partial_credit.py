"""A dense reward for GRPO runs that start from a random-init model (the GPU end-to-end run).

reward = (characters of the answer matched at the same position of the completion) / len(answer),
minus 0.1 if the completion runs past the answer's length. A random model over the default
15-token vocab earns ~0.07 and rarely 0, so advantages are non-zero from the first step, and the
reward keeps room to rise (a full 1.0 needs the arithmetic right), unlike a format-only reward.
"""


def positional_match(prompt: str, completion: str, answer: str) -> float:
    matched = sum(a == b for a, b in zip(completion, answer))
    return matched / max(len(answer), 1) - (0.1 if len(completion) > len(answer) else 0.0)


#: match_then_stop's cost of one completion character beyond the answer's length: 64 tokens of the
#: full-vocabulary tokenizer (<= 6 digits each, ~350 characters) cost ~0.87, so every token counts.
EXTRA_CHAR_COST = 1 / 400


def match_then_stop(prompt: str, completion: str, answer: str) -> float:
    """Credit for the answer's characters at their places, a cost for every character beyond them.

    reward = matched / len(answer) - EXTRA_CHAR_COST * max(0, len(completion) - len(answer)), where
    matched counts the positions i < len(answer) with completion[i] == answer[i] (as positional_match).
    1.0 iff completion == answer; the empty completion scores 0. Unlike positional_match's flat -0.1
    for any overrun, the cost grows with each extra character, so a completion that stops (<eos>)
    after k tokens earns more the smaller k is (with rollout.ignore_eos, one made of <eos> tokens, which
    decode to nothing, and one-digit tokens): the one thing a prompt-blind random-init policy over
    151,936 number tokens can learn within a few hundred steps (the answer's digits depend on the
    prompt; the best prompt-blind first token lifts positional_match by only ~0.05: 0.069 against the uniform
    policy's 0.018).
    ``prompt`` is unused.
    """
    del prompt
    return _matched_minus_extra(completion, answer, EXTRA_CHAR_COST)


#: match_then_steep's cost per character beyond the answer: the length term must carry a sampled token's
#: credit. A 64-token completion's length varies by ~3.8 characters (5- vs 6-character ids), its matched
#: places by ~0.17 of the reward; at 1/400 a character is worth 0.015 of a group's reward std (the 8B run
#: learned nothing and collapsed onto random ids), at 1/16 0.21 (the ceiling, length alone, is 1/3.8 = 0.26).
STEEP_EXTRA_CHAR_COST = 1 / 16


def match_then_steep(prompt: str, completion: str, answer: str) -> float:
    """match_then_stop with a cost of 1/16 per character beyond the answer (STEEP_EXTRA_CHAR_COST).

    reward = matched / len(answer) - STEEP_EXTRA_CHAR_COST * max(0, len(completion) - len(answer)):
    1.0 iff completion == answer, 0 for the empty completion, about -21 for 64 random number tokens
    (~340 characters). GRPO normalises each group's rewards, so the scale does not matter, the split of
    their variance does: here most of it is the completion's length, so a one-character token (or
    <eos>) in a sampled completion moves its advantage by ~0.8 of a group std instead of ~0.06 under
    match_then_stop, while a matched place of the answer still earns as much as 16 characters.
    ``prompt`` is unused.
    """
    del prompt
    return _matched_minus_extra(completion, answer, STEEP_EXTRA_CHAR_COST)


def _matched_minus_extra(completion: str, answer: str, cost: float) -> float:
    """matched / len(answer) - cost * (characters of the completion beyond the answer's length)."""
    matched = sum(a == b for a, b in zip(completion, answer))
    extra = max(0, len(completion) - len(answer))
    return matched / max(len(answer), 1) - cost * extra
