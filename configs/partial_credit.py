"""A dense reward for GRPO runs that start from a random-init model (the GPU end-to-end run).

reward = (characters of the answer matched at the same position of the completion) / len(answer),
minus 0.1 if the completion runs past the answer's length. A random model over the default
15-token vocab earns ~0.07 and rarely 0, so advantages are non-zero from the first step, and the
reward keeps room to rise (a full 1.0 needs the arithmetic right), unlike a format-only reward.
"""


def positional_match(prompt: str, completion: str, answer: str) -> float:
    matched = sum(a == b for a, b in zip(completion, answer))
    return matched / max(len(answer), 1) - (0.1 if len(completion) > len(answer) else 0.0)
