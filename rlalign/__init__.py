"""RL-Align: RL post-training whose rollout and training log-probs are bit-for-bit identical."""

__version__ = "0.1.0"


def enable() -> None:
    """Turn on rlalign's vLLM plugin: vLLM engines created afterwards (in this process and the processes it
    starts) run Qwen3 / Qwen2 / Llama with rlalign's strict ops and sampler. Same as ``RLALIGN_VLLM=1``;
    see docs/vllm.md."""
    from rlalign.integrations.vllm import enable as enable_vllm_plugin
    enable_vllm_plugin()
