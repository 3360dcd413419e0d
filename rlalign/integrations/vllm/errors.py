"""Errors of the vLLM integration (one line each: what is unsupported and what to do instead)."""

from rlalign.contract.errors import RLAlignError


class UnsupportedVLLMConfigError(RLAlignError, ValueError):
    """vLLM was configured (model, engine or request settings) in a way the rlalign plugin cannot run bitwise."""

    def __init__(self, problem: str):
        super().__init__(f"rlalign vLLM plugin: {problem}")
