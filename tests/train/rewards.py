"""A dense reward for tests: a random tiny model earns it often enough that updates are non-zero."""


def first_digit(prompt: str, completion: str, answer: str) -> float:
    return 1.0 if completion[:1] == answer[:1] else 0.0


def constant(prompt: str, completion: str, answer: str) -> float:
    """The same reward for every completion: every group has zero variance, so no GRPO signal."""
    return 0.5
