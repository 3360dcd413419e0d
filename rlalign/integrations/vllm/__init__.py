"""vLLM as an rlalign rollout engine: a vLLM general plugin that runs Qwen3 / Qwen2 / Llama with rlalign strict ops.

Off by default. Turn it on with ``RLALIGN_VLLM=1`` in the environment of every vLLM process (the
usual way for a deployment: vLLM loads ``vllm.general_plugins`` entry points in the API server,
engine core and worker processes), or with ``rlalign.enable()`` before creating ``vllm.LLM``
(which sets the same variable, so vLLM's child processes see it too):

    import rlalign, vllm
    rlalign.enable()
    llm = vllm.LLM(model="ckpt/", dtype="float32", ...)
    out = llm.generate(prompts, vllm.SamplingParams(temperature=1.0, seed=s, logprobs=0, max_tokens=64))

When on, the plugin (1) registers :class:`~rlalign.integrations.vllm.model.RLAlignForCausalLM` for
every architecture of rlalign's registry (:mod:`rlalign.models.architectures`: ``Qwen3ForCausalLM``,
``Qwen2ForCausalLM``, ``LlamaForCausalLM``; it replaces vLLM's own classes for them), and (2) hooks vLLM's sampler so that a step whose logits came from
that model is sampled by ``ops.sample`` and its sampled-token logprob computed by
``ops.logprob_entropy`` on the same final hidden row as rlalign's trainer. Settings it cannot
run bitwise are refused with :class:`UnsupportedVLLMConfigError` (see :mod:`.checks` and
:mod:`.sampler`).
"""

from rlalign.integrations.vllm.engine import build_training_engine
from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError
from rlalign.integrations.vllm.parity import VLLMRollout
from rlalign.integrations.vllm.plugin import ARCHITECTURES, ENV, disable, enable, is_enabled, register
from rlalign.train.engines import register_engine

register_engine("vllm", build_training_engine)   # rollout.engine=vllm; the parity side registers in .parity

__all__ = ["enable", "disable", "is_enabled", "register", "UnsupportedVLLMConfigError", "ENV", "ARCHITECTURES",
           "VLLMRollout", "build_training_engine"]
