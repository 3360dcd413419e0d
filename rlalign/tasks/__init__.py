"""Tasks: the built-in arithmetic task, GSM8K-style rewards, dataset loading, reward functions
by import path, and the worker process the trainer runs rewards in.

A reward function has the signature ``fn(prompt: str, completion: str, answer: str) -> float``.
"""

from rlalign.tasks.arithmetic import (
    BOS_TOKEN,
    CHARS,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    VOCAB,
    ArithmeticTask,
    Problem,
    arithmetic_reward,
    parse_answer,
)
from rlalign.tasks.datasets import DatasetError, Example, load_dataset, load_examples, read_rows, split_examples
from rlalign.tasks.registry import BUILTIN_REWARDS, RewardError, RewardLoadError, load_reward, score
from rlalign.tasks.reward_worker import RewardWorker
from rlalign.tasks.rewards import (
    extract_hash_answer,
    extract_last_number,
    gsm8k_reward,
    gsm8k_reward_fallback,
    gsm8k_reward_last_number,
    gsm8k_score,
)

__all__ = [
    "BOS_TOKEN", "BUILTIN_REWARDS", "CHARS", "EOS_TOKEN", "PAD_TOKEN", "SPECIAL_TOKENS", "VOCAB",
    "ArithmeticTask", "DatasetError", "Example", "Problem", "RewardError", "RewardLoadError", "RewardWorker",
    "arithmetic_reward", "extract_hash_answer", "extract_last_number", "gsm8k_reward",
    "gsm8k_reward_fallback", "gsm8k_reward_last_number", "gsm8k_score", "load_dataset",
    "load_examples", "load_reward", "parse_answer", "read_rows", "score", "split_examples",
]
