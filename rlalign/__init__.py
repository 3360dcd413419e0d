"""RL-Align: RL post-training whose rollout and training log-probs are bit-for-bit identical."""

from rlalign.version import __version__

__all__ = ["__version__", "enable"]


def enable() -> None:
    """Turn on rlalign's vLLM plugin: vLLM engines created afterwards (in this process and the processes it
    starts) run Qwen3 / Qwen2 / Llama with rlalign's strict ops and sampler. Same as ``RLALIGN_VLLM=1``;
    see docs/vllm.md."""
    # the package facade sits above every layer: importing the integrations at module level would load them
    # all (and every layer below them) on any `import rlalign.<anything>`
    from rlalign.integrations.vllm import enable as enable_vllm_plugin  # lazy: see above
    enable_vllm_plugin()
