"""The training config: one dataclass per section, loaded from YAML + dotted overrides.

``rlalign train`` with no arguments uses these defaults: GRPO on the embedded default model and
the built-in addition task, on the CPU, in the strict profile.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlalign.algos.registry import (
    ADVANTAGES,
    KL_ESTIMATOR_REGISTRY,
    MISMATCH_CORRECTIONS,
    POLICY_LOSSES,
    refused_setting,
)


@dataclasses.dataclass
class ModelSection:
    path: str = "default"              # a Hugging Face checkpoint dir, or "default" (the embedded model)
    dtype: str | None = None           # float32 | bfloat16; None: the checkpoint's
    device: str = "cpu"                # cpu | cuda

    def validate(self):
        if self.dtype not in (None, "float32", "bfloat16"):
            return f"dtype must be float32 or bfloat16 (strict), got {self.dtype!r}"
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            return f"device must be cpu or cuda, got {self.device!r}"


@dataclasses.dataclass
class TaskSection:
    name: Literal["arithmetic", "dataset"] = "arithmetic"
    reward: str = "builtin"            # builtin | gsm8k | gsm8k_last_number | module:function
    min_digits: int = 1                # arithmetic
    max_digits: int = 3
    eval_size: int = 200
    path: str | None = None            # dataset: a .jsonl / .json / .parquet file
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    template: str | None = None        # e.g. "Question: {prompt}\nAnswer:"
    eval_fraction: float = 0.1
    chat: bool = False                 # apply the tokenizer's chat template to prompts

    def validate(self):
        if self.name == "dataset" and not self.path:
            return "path is required when name is 'dataset' (task.path=data.jsonl)"


@dataclasses.dataclass
class RolloutSection:
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    page_size: int = 16
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 8192
    kv_cache_bytes: int | None = None
    engine: str = "rlalign"            # which rollout engine (rlalign.train.engines.ENGINES)
    decode_graphs: str = "auto"        # CUDA-graph decode steps (RolloutConfig.decode_graphs): auto | on | off

    def validate(self):
        from rlalign.train.engines import ENGINES
        if self.engine not in ENGINES:
            return f"engine must be one of {sorted(ENGINES)}, got {self.engine!r}"
        if self.prompts_per_step < 1 or self.samples_per_prompt < 1 or self.max_new_tokens < 1:
            return "prompts_per_step, samples_per_prompt and max_new_tokens must be >= 1"
        if self.temperature <= 0:
            return f"temperature must be > 0 for RL rollouts, got {self.temperature}"
        if self.decode_graphs not in ("auto", "on", "off"):
            return f"decode_graphs must be one of auto, on, off, got {self.decode_graphs!r}"


@dataclasses.dataclass
class AlgoSection:
    """The algorithm (rlalign.algos.registry): a key the chosen algorithms do not read is refused when set.
    ``None`` for clip_low / clip_high: the chosen policy loss's own default (ppo_clip 0.2 / 0.28)."""
    advantage: Literal[ADVANTAGES.names()] = "grpo"       # gae: PPO with a value model
    policy_loss: Literal[POLICY_LOSSES.names()] = "ppo_clip"
    clip_low: float | None = None
    clip_high: float | None = None     # ppo_clip default 0.28: DAPO clip-higher
    dual_clip: float | None = None     # ppo_clip, e.g. 3.0
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: Literal[KL_ESTIMATOR_REGISTRY.names()] = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    dynamic_sampling: bool = False     # DAPO: drop zero-variance groups, draw more
    max_draw_rounds: int = 3
    overlong_filter: bool = False      # mask truncated completions
    mismatch_correction: Literal[MISMATCH_CORRECTIONS.names()] = "none"
    mismatch_cap: float = 2.0          # TIS cap C / MIS upper bound
    ppo_epochs: int = 1
    mini_batches: int = 1              # optimizer steps per epoch over the step's samples (verl's ppo_mini_batch_size)
    gamma: float = 1.0                 # gae, reinforce_pp
    lam: float = 0.95                  # gae
    value_lr: float = 1e-3             # gae: AdamW lr of the value model
    value_clip: float | None = 0.2     # gae: PPO2 value clipping around the old values

    def validate(self):
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            return f"ppo_epochs and mini_batches must be >= 1, got {self.ppo_epochs} and {self.mini_batches}"
        defaults = {f.name: f.default for f in dataclasses.fields(AlgoSection)}
        return refused_setting(dataclasses.asdict(self), defaults)


@dataclasses.dataclass
class OptimSection:
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.99])
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096
    activation_checkpointing: bool = False


@dataclasses.dataclass
class RunSection:
    dir: str | None = None             # default: runs/<timestamp>
    steps: int = 120
    seed: int = 0
    profile: Literal["strict", "native"] = "strict"
    on_mismatch: Literal["warn", "stop"] = "warn"
    eval_every: int = 10
    eval_samples: int = 2              # samples per held-out problem for eval/accuracy (at the rollout temperature)
    checkpoint_every: int = 20
    resume: bool = False
    progress: bool = True
    max_minutes: float | None = None   # stop (after a checkpoint) when exceeded


@dataclasses.dataclass
class RaySection:
    """``launcher=ray``: the trainer and the rollout workers run as Ray actors (docs/ray.md)."""
    address: str | None = None         # None: start a local cluster; "auto", "HOST:6379" or "ray://HOST:10001": join one
    num_rollout_workers: int = 2
    cpus_per_actor: float = 1.0        # Ray CPUs of the trainer and of each worker (also its torch threads)
    gpus_per_actor: float = 0.0        # 1 with model.device=cuda
    weight_sync: Literal["auto", "object_store", "broadcast"] = "auto"   # auto: broadcast on cuda (NCCL), object store on cpu

    def validate(self):
        if self.num_rollout_workers < 1:
            return f"num_rollout_workers must be >= 1, got {self.num_rollout_workers}"
        if self.cpus_per_actor <= 0 or self.gpus_per_actor < 0:
            return "cpus_per_actor must be > 0 and gpus_per_actor >= 0"


@dataclasses.dataclass
class ParallelSection:
    """Trainer parallelism (docs/distributed.md); dp * tp processes (gloo on CPU, NCCL on GPU), spawned by
    ``rlalign train parallel.dp=2`` or started by torchrun (WORLD_SIZE must equal dp * tp).
    dp: each rank back-propagates a share of every step's micro-batches; a deterministic all-reduce sums
    the gradients. tp: the policy is sharded (rlalign.distributed.parallelize); None keeps the unsharded
    model, 1/2/4/8 use the canonical partitions, and every tp gives the same bits as tp=1."""
    dp: int = 1
    tp: int | None = None

    def validate(self):
        if self.dp < 1:
            return f"dp must be >= 1, got {self.dp}"
        if self.tp is not None and self.tp not in (1, 2, 4, 8):
            return f"tp must be 1, 2, 4 or 8 (or unset), got {self.tp}"

    @property
    def world_size(self) -> int:
        return self.dp * (self.tp or 1)


@dataclasses.dataclass
class TrainConfig:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    task: TaskSection = dataclasses.field(default_factory=TaskSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    algo: AlgoSection = dataclasses.field(default_factory=AlgoSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    run: RunSection = dataclasses.field(default_factory=RunSection)
    launcher: Literal["local", "ray"] = "local"   # ray: trainer + rollout workers as Ray actors (`launcher=ray`)
    ray: RaySection = dataclasses.field(default_factory=RaySection)
    parallel: ParallelSection = dataclasses.field(default_factory=ParallelSection)

    def validate(self):
        if self.parallel.world_size > 1 and self.launcher != "local":
            return f"parallel.dp/tp > 1 run with launcher=local (got launcher={self.launcher})"
        if self.parallel.tp is not None and self.algo.advantage == "gae":
            return "parallel.tp does not support the PPO value model (algo.advantage=gae) yet"
