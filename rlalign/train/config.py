"""The training config: one dataclass per section, loaded from YAML + dotted overrides.

``rlalign train`` with no arguments uses these defaults: GRPO on the embedded default model and
the built-in addition task, on the CPU, in the strict profile.
"""

from __future__ import annotations

import dataclasses
from typing import Literal


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
    name: Literal["arithmetic", "dataset"] = "arithmetic"   # arithmetic (built-in addition) | dataset (task.path)
    reward: str = "builtin"            # builtin | gsm8k | gsm8k_last_number | module:function (docs/data_and_rewards.md)
    min_digits: int = 1                # arithmetic: fewest digits per operand
    max_digits: int = 3                # arithmetic: most digits per operand
    eval_size: int = 200               # held-out problems evaluated (0 with a dataset: all of its eval split)
    path: str | None = None            # dataset: a .jsonl / .json / .parquet file
    prompt_field: str = "prompt"       # dataset: the row field holding the prompt (a string or a list of chat messages)
    answer_field: str = "answer"       # dataset: the row field passed to the reward as the answer
    template: str | None = None        # e.g. "Question: {prompt}\nAnswer:"
    eval_fraction: float = 0.1         # dataset: share of rows held out for eval
    chat: bool = False                 # apply the tokenizer's chat template to prompts (message-list prompts always are)
    system_prompt: str | None = None   # chat: a system message put before each prompt that has none
    enable_thinking: bool | None = None   # chat: the template's enable_thinking (Qwen3: false = no <think> block); None: unset

    def validate(self):
        if self.name == "dataset" and not self.path:
            return "path is required when name is 'dataset' (task.path=data.jsonl)"


@dataclasses.dataclass
class RolloutSection:
    prompts_per_step: int = 32         # prompts (groups) per optimizer step
    samples_per_prompt: int = 8        # completions per prompt (the GRPO group size)
    max_new_tokens: int = 6            # completion length limit (longer ones are truncated)
    temperature: float = 1.0           # sampling temperature (the trainer scores at the same one)
    top_p: float = 1.0                 # nucleus sampling (1.0: off)
    top_k: int = 0                     # top-k sampling (0: off)
    page_size: int = 16                # KV-cache page size in tokens
    max_num_seqs: int = 512            # sequences decoded at once
    max_num_batched_tokens: int = 8192 # token budget of one engine step (chunked prefill)
    kv_cache_bytes: int | None = None  # KV-cache size; None: sized from the batch
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
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"   # advantage estimator (gae: PPO with a value model)
    policy_loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"   # surrogate objective
    clip_low: float = 0.2              # ratio clip below: 1 - clip_low
    clip_high: float = 0.28            # ratio clip above: 1 + clip_high (DAPO clip-higher)
    dual_clip: float | None = None     # dual-clip bound for negative advantages, e.g. 3.0
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"   # loss aggregation over tokens and sequences
    kl_coef: float = 0.0               # KL-to-reference penalty weight (0: no reference model)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"   # KL estimator of the penalty
    kl_in_reward: bool = False         # fold the KL penalty into the reward instead of the loss
    entropy_coef: float = 0.0          # entropy bonus weight
    dynamic_sampling: bool = False     # DAPO: drop zero-variance groups, draw more
    max_draw_rounds: int = 3           # dynamic_sampling: most draws per step
    overlong_filter: bool = False      # mask truncated completions
    mismatch_correction: Literal["none", "token_tis", "seq_tis", "token_mis", "seq_mis"] = "none"   # importance-sampling correction (native profile)
    mismatch_cap: float = 2.0          # TIS cap C / MIS upper bound
    ppo_epochs: int = 1                # optimizer passes over each step's samples
    gamma: float = 1.0                 # gae: discount
    lam: float = 0.95                  # gae: lambda
    value_lr: float = 1e-3             # gae: AdamW lr of the value model
    value_clip: float | None = 0.2     # gae: PPO2 value clipping around the old values


@dataclasses.dataclass
class OptimSection:
    lr: float = 2e-4                   # AdamW peak learning rate
    weight_decay: float = 0.0          # AdamW weight decay
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.99])   # AdamW betas
    warmup_steps: int = 5              # linear warmup steps, then cosine decay
    min_lr_ratio: float = 0.1          # final lr as a fraction of optim.lr
    grad_clip: float = 1.0             # gradient norm clip
    micro_batch_tokens: int = 4096     # token budget of one forward/backward micro-batch
    activation_checkpointing: bool = False   # recompute each layer in backward (same bits, less memory)
    master_weights: bool = True        # low-precision (bf16) weights train against fp32 master weights + fp32 AdamW state
    offload: bool = False              # keep the fp32 master weights and AdamW state in CPU memory (large models)


@dataclasses.dataclass
class RunSection:
    dir: str | None = None             # default: runs/<timestamp>
    steps: int = 120                   # optimizer steps of the run
    seed: int = 0                      # seed of the data order and the sampling
    profile: Literal["strict", "native"] = "strict"   # strict: bit-identical logprobs; native: vendor kernels
    on_mismatch: Literal["warn", "stop"] = "warn"     # strict profile: what a train/rollout mismatch does
    eval_every: int = 10               # held-out eval every N steps (and at the last)
    eval_samples: int = 2              # samples per held-out problem for eval/accuracy (at the rollout temperature)
    checkpoint_every: int = 20         # checkpoint every N steps (and at the last)
    resume: bool = False               # continue the run in run.dir from its latest checkpoint and saved config.yaml
    resume_override: list[str] = dataclasses.field(default_factory=list)   # keys a resume may change that alter the run's meaning
    progress: bool = True              # live progress bar (on a terminal only)
    log_every: int = 1                 # one plain log line every N steps
    policy_kl: bool = False            # log kl/policy_step, k3 KL(pi_before || pi_after) of each update (one extra forward)
    loggers: list[str] = dataclasses.field(default_factory=lambda: ["jsonl"])   # jsonl (always) | tensorboard | wandb
    metric_names: Literal["rlalign", "verl", "trl"] = "rlalign"   # metric names in tensorboard / wandb
    keep_checkpoints: int = 2          # newest checkpoints kept in run.dir/checkpoints
    max_minutes: float | None = None   # stop (after a checkpoint) when exceeded

    def validate(self):
        from rlalign.train.trackers import TRACKERS
        unknown = [name for name in self.loggers if name not in TRACKERS]
        if unknown:
            return f"loggers: unknown {unknown}; choose from {sorted(TRACKERS)}"
        if self.log_every < 1 or self.keep_checkpoints < 1:
            return "log_every and keep_checkpoints must be >= 1"


@dataclasses.dataclass
class RaySection:
    """``launcher=ray``: the trainer and the rollout workers run as Ray actors (docs/ray.md)."""
    address: str | None = None         # None: start a local cluster; "auto", "HOST:6379" or "ray://HOST:10001": join one
    num_rollout_workers: int = 2       # rollout engine actors
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
    dp: int = 1                        # data-parallel trainer processes
    tp: int | None = None              # tensor-parallel degree (None: unsharded)

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
