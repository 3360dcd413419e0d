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


def one_line(exc: BaseException, limit: "int | None" = None) -> str:
    """``exc`` as one line for a message: its type and its text with every run of whitespace a single space (the
    text cut to ``limit`` characters where given)."""
    text = " ".join(str(exc).split())
    if limit is not None:
        text = text[:limit]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
