"""Configuration of the rollout engine (:class:`RolloutConfig`) and of one request (:class:`SamplingParams`).

None of the engine knobs changes a sampled token or a logprob: a token's hidden row does not
depend on the batch, the page layout or the prefill chunking (strict contract), and the sampler's
random key is (per-sample seed, seq id, position), fixed by the request alone. They only move
memory and speed.
"""

from __future__ import annotations

import dataclasses
import math

from rlalign.contract.profiles import as_profile
from rlalign.models.latent_cache import MLA_CACHE_FORMS
from rlalign.ops import temperature as temperature_rule
from rlalign.rollout.errors import RequestError, RolloutConfigError

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
SEED_KEYS = ("index", "content")
LOGPROB_MODES = ("full", "sampled")
DECODE_GRAPH_MODES = ("auto", "on", "off", "padded")
OVERLAP_MODES = ("auto", "on", "off")


@dataclasses.dataclass
class RolloutConfig:
    """Engine configuration.

    profile: ``"strict"`` (bitwise agreement with the trainer), ``"native"`` (vendor kernels) or ``"portable"``
        (strict's agreement, the same bits on the CPU and on a CUDA GPU; eager, slow: docs/portable.md);
        the engine enters :func:`rlalign.contract.use_profile` around its forwards and sampling.
    page_size: tokens per KV page (block).
    max_num_seqs: most sequences running at once (the decode batch).
    max_num_batched_tokens: token budget of one step (decodes + prefill chunks, one forward).
    max_prefill_chunk: most new tokens of one sequence in one step (None: only the budget limits).
    share_prefix: the ``n`` samples of a request prefill their prompt once and share its pages
        (copy-on-write of the partial last page); off: every sample prefills on its own.
    enable_prefix_caching: full pages are hashed by their token prefix and reused across requests.
    kv_cache_bytes: KV cache budget (K and V of every layer); default 1 GiB on the CPU, and on a GPU
        ``gpu_memory_fraction`` of the free memory at engine creation.
    num_pages: exact number of KV pages (overrides the byte budget; tests use it to force preemption).
    max_model_len: longest sequence (prompt + completion); default the model's max_position_embeddings.
    admission_watermark: fraction of pages kept free when admitting new sequences (fewer preemptions).
    decode_graphs: ``"auto"`` replays decode steps from CUDA graphs on a GPU, in both profiles
        (:mod:`rlalign.rollout.decode_graphs`) and runs eagerly otherwise; ``"on"`` requires them (a
        CUDA device); ``"off"`` always eager; ``"padded"`` runs the graphs' padded static batches
        eagerly (any device; tests use it to show padding changes no bit in strict).
    decode_graph_max_batch: largest decode batch with a graph (bigger decode steps run eagerly).
    overlap: overlapped scheduling (docs/rollout.md, "Overlapped scheduling"): while a decode step runs on the
        device, the host plans and launches the next one, whose input ids are the running step's sampled
        tokens copied on the device. Needs decode steps sampled inside the decode graphs (graphs on CUDA,
        except a native MoE model whose experts read their loads on the host, or ``decode_graphs="padded"``). ``"auto"``: on for an engine replaying
        CUDA graphs, off otherwise; ``"on"`` requires it (``"padded"`` runs it on the CPU: the tests);
        ``"off"``: every step runs serially. Changes no token, logprob, finish reason or routing record.
    record_routing: for a mixture-of-experts model, record the experts each fed row was routed to and
        return them as ``Completion.routing`` (:mod:`rlalign.rollout.routing`; the trainer's routing-agreement
        metric). Off by default (a dense model refuses it); training turns it on for MoE models.
    mla_cache: what a multi-head-latent-attention model (DeepSeek-V3) caches per token and layer: ``"latent"``
        (the default: its compressed latent, kv_lora_rank + qk_rope_head_dim values, re-expanded to per-head K/V at
        every call) or ``"expanded"`` (the per-head K and zero-padded V: 2 x heads x (qk_nope + qk_rope) values,
        85x the latent's bytes at DeepSeek-V3's shape, no re-expansion). The same bits either way
        (rlalign.models.latent_cache; docs/models.md); other models ignore it.
    """

    profile: str = "strict"
    page_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_prefill_chunk: int | None = None
    share_prefix: bool = True
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.8
    num_pages: int | None = None
    max_model_len: int | None = None
    admission_watermark: float = 0.01
    decode_graphs: str = "auto"
    decode_graph_max_batch: int = 1024
    overlap: str = "auto"
    record_routing: bool = False
    mla_cache: str = "latent"

    def __post_init__(self) -> None:
        self.profile = as_profile(self.profile).value
        if self.decode_graphs not in DECODE_GRAPH_MODES:
            raise RolloutConfigError(f"RolloutConfig.decode_graphs must be one of {DECODE_GRAPH_MODES}, "
                                     f"got {self.decode_graphs!r}")
        if self.mla_cache not in MLA_CACHE_FORMS:
            raise RolloutConfigError(f"RolloutConfig.mla_cache must be one of {MLA_CACHE_FORMS}, got {self.mla_cache!r}")
        if self.overlap not in OVERLAP_MODES:
            raise RolloutConfigError(f"RolloutConfig.overlap must be one of {OVERLAP_MODES}, got {self.overlap!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "decode_graph_max_batch"):
            _positive(f"RolloutConfig.{name}", getattr(self, name), RolloutConfigError)
        for name in ("max_prefill_chunk", "kv_cache_bytes", "num_pages", "max_model_len"):
            if getattr(self, name) is not None:
                _positive(f"RolloutConfig.{name}", getattr(self, name), RolloutConfigError)
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise RolloutConfigError(f"RolloutConfig.gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if not 0.0 <= self.admission_watermark < 1.0:
            raise RolloutConfigError(f"RolloutConfig.admission_watermark must be in [0, 1), got {self.admission_watermark}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    n: samples per prompt (a GRPO group). Sample j of the prompt with key k uses the per-sample seed
        ``s = ops.derive_seed(seed, k, j)``; the token at absolute position p (and its logprob) is
        ``ops.sample_and_score(h, W, seeds=s, positions=p, ...)`` (``ops.sample`` with ``seq_ids=s``).
        The key k is the prompt index
        (``seed_by="index"``) or a 63-bit hash of the prompt's token ids (``seed_by="content"``,
        :func:`rlalign.models.generate.prompt_key`, as ``rlalign.models.generate`` does).
    temperature: 0 = greedy. Logprobs are reported at this temperature (at 1.0 when greedy).
    top_k: 0 = off. top_p: 1.0 = off. min_p: 0.0 = off (vLLM's: keep tokens with probability >= min_p x the
        largest; applied before top-k / top-p, ``ops.sample``).
    logprobs: ``"full"``: each token's log-prob under the full softmax at the logprob temperature;
        ``"sampled"``: under the distribution it was drawn from (the kept set of temperature, min-p, top-k,
        top-p, renormalised; ``ops.sampled_logprob``; strict profile; such steps sample outside the decode graphs).
    max_new_tokens: most generated tokens per sample.
    stop_token_ids: extra token ids that end a sample (the token is kept).
    ignore_eos: do not stop at the model's / tokenizer's eos ids.
    stop: stop strings (need a tokenizer); a sample ends once its decoded text contains one
        (the token that completed it is kept).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logprobs: str = "full"
    max_new_tokens: int = 64
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    seed_by: str = "index"

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        _positive("SamplingParams.n", self.n)
        _positive("SamplingParams.max_new_tokens", self.max_new_tokens)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"SamplingParams.temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"SamplingParams.top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"SamplingParams.min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.logprobs not in LOGPROB_MODES:
            raise RequestError(f"SamplingParams.logprobs must be one of {LOGPROB_MODES}, got {self.logprobs!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise RequestError(f"SamplingParams.seed must be an int, got {self.seed!r}")
        if self.seed_by not in SEED_KEYS:
            raise RequestError(f"SamplingParams.seed_by must be one of {SEED_KEYS}, got {self.seed_by!r}")
        if any(not s for s in self.stop):
            raise RequestError("SamplingParams.stop: stop strings must be non-empty")

    @property
    def logprob_temperature(self) -> float:
        """The temperature logprobs are reported at (the sampling one; 1.0 for greedy): ops.logprob_temperature."""
        return temperature_rule.logprob_temperature(self.temperature)


def _positive(name: str, value, error: type = RequestError) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise error(f"{name} must be a positive int, got {value!r}")
