"""A dense reward for GRPO runs on random-init models (the GPU end-to-end run): the fraction of
the completion's characters that are digits. A random model over the default 15-token vocab
earns about 10/15 of it, so advantages are non-zero from step 1 and the reward can rise."""


def digit_fraction(prompt: str, completion: str, answer: str) -> float:
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0
