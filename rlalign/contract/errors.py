"""Errors raised when an op cannot honour the numerical contract (fail closed)."""


class RLAlignError(Exception):
    """Base of every error that reports bad input or a broken invariant to the user.

    The CLI prints these as one line (``rlalign <cmd>: error: <message>``) with exit code 2.
    """


class ContractError(RLAlignError, RuntimeError):
    """An op in the strict profile was asked for something it cannot do under the contract.

    The message always names the op and the problem, e.g.
    ``rlalign.ops.linear: dtype torch.float16 is not supported in strict (use bfloat16 or float32)``.
    """


def fail(op: str, problem: str) -> "ContractError":
    return ContractError(f"rlalign.ops.{op}: {problem}")
