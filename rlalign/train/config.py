"""The training config: one dataclass per section, loaded from YAML + dotted overrides.

``rlalign train`` with no arguments uses these defaults: GRPO on the embedded default model and
the built-in addition task, on the CPU, in the strict profile.
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar, Literal

from rlalign.configlib import (Rule, at_least, checked_by_type, greater_than, guarded_keys, non_empty, one_of,
                               pair_within, unusual_value, usual, within)
from rlalign.tasks.arithmetic import MAX_DIGITS
from rlalign.tasks.reward_terms import term_problem
from rlalign.algos.registry import (
    ADVANTAGES,
    KL_ESTIMATOR_REGISTRY,
    MISMATCH_CORRECTIONS,
    POLICY_LOSSES,
    refused_setting,
)

from rlalign.train.engines import ENGINES, INTEGRATIONS_HINT


# parallel.shard: none, grads (rlalign.train.sharding: ZeRO-2 style over the dp ranks) or params (the weights too:
# rlalign.train.weight_shards, ZeRO-3 style)
SHARD_MODES = ("none", "grads", "params")

# run.loggers: where metrics go (rlalign.train.run.trackers.TRACKERS has one entry per name)
LOGGERS = ("jsonl", "tensorboard", "wandb")


@dataclasses.dataclass
class LoRASection:
    """LoRA adapters (docs/lora.md): rank 0 trains every weight; rank >= 1 trains only low-rank adapters of the
    targeted projections (rlalign.models.lora), the base weights frozen."""
    CHECKS: ClassVar[dict[str, Rule]] = {
        "rank": at_least(0),
        "alpha": greater_than(0),
        "dropout": within(0, 1, high_open=True),
        "targets": Rule("a list of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj", lambda t: (
            isinstance(t, list) and len(t) > 0 and len(set(t)) == len(t) and all(x in LORA_TARGETS for x in t)),
            (["qkv"], [], ["q_proj", "q_proj"])),
        "path": non_empty("a PEFT adapter folder", optional=True),
    }
    rank: int = 0                      # adapter rank r (0: no adapters, full fine-tuning)
    alpha: float = 16.0                # scale s = alpha / r
    dropout: float = 0.0               # dropout on the adapters' input (refused in the strict profile)
    targets: list[str] = dataclasses.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])   # projections adapted in every layer
    path: str | None = None            # start from this PEFT adapter folder (its rank, alpha and targets must match)

    def conflict(self, cfg) -> "str | None":
        """What of the run (``cfg``: the whole TrainConfig) adapters cannot join, in one line; None: nothing."""
        if self.rank == 0:
            return None
        if self.dropout > 0 and cfg.run.profile == "strict":
            return (f"model.lora.dropout={self.dropout}: dropout makes the training forward differ from the "
                    "rollout's, which the strict profile's bitwise contract forbids; set model.lora.dropout=0 "
                    "(or run.profile=native)")
        if cfg.parallel.tp is not None:
            return "model.lora with parallel.tp is not supported yet; use parallel.dp (or no parallel.tp)"
        if cfg.launcher != "local":
            return (f"model.lora with launcher={cfg.launcher} is not supported yet (its workers load the base model "
                    "only); use launcher=local")
        if cfg.rollout.engine != "rlalign":
            return (f"model.lora with rollout.engine={cfg.rollout.engine} is not supported (its engine does not run "
                    "adapters); use rollout.engine=rlalign")
        return None


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class ModelSection:
    CHECKS: ClassVar[dict[str, Rule]] = {
        "path": non_empty("a checkpoint directory or 'default'"),
        "dtype": one_of("float32", "bfloat16", optional=True),
        "device": Rule("cpu, cuda or cuda:N", lambda d: isinstance(d, str) and (
            d in ("cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())), ("gpu", "cuda:x")),
        "lora": checked_by_type("a mapping of rank, alpha, dropout, targets, path", bad=("bogus", 8, [8])),
    }
    path: str = "default"              # a Hugging Face checkpoint dir, or "default" (the embedded model)
    dtype: str | None = None           # float32 | bfloat16; None: the checkpoint's
    device: str = "cpu"                # cpu | cuda
    lora: LoRASection = dataclasses.field(default_factory=LoRASection)


@dataclasses.dataclass
class TaskSection:
    CHECKS: ClassVar[dict[str, Rule]] = {
        "name": checked_by_type("arithmetic or dataset"),
        "reward": non_empty("builtin, a reward name or module:function"),
        "min_digits": within(1, MAX_DIGITS),
        "max_digits": within(1, MAX_DIGITS),
        "eval_size": at_least(0),
        "path": non_empty("a dataset file", optional=True),
        "prompt_field": non_empty(),
        "answer_field": non_empty(),
        "template": Rule("a string holding {prompt}", lambda t: isinstance(t, str) and "{prompt}" in t,
                         ("Question:",), optional=True),
        "eval_fraction": within(0, 1, low_open=True, high_open=True),
        "chat": checked_by_type("true or false"),
        "system_prompt": non_empty("a system message", optional=True),
        "enable_thinking": checked_by_type("true, false or null"),
        "reward_timeout_s": within(0, 86400, low_open=True),
        "rewards": Rule("a list of mappings ({name: REWARD, weight: W} or {reward_model: DIR, weight: W})",
                        lambda x: all(isinstance(e, dict) for e in x), (["gsm8k"], [1])),
        "columns": Rule("a mapping {name: column} of non-empty strings", lambda x: isinstance(x, dict) and all(
            isinstance(k, str) and k.strip() and isinstance(v, str) and v.strip() for k, v in x.items()),
            ("prompt", {"prompt": ""})),
        "split": non_empty("a split name"),
        "eval_path": non_empty("a held-out dataset file or folder", optional=True),
        "eval_split": non_empty("a split name"),
        "shuffle": checked_by_type("true or false"),
        "streaming": checked_by_type("true or false"),
        "shuffle_buffer": at_least(1),
        "env": non_empty("an env name (retry_arithmetic, calculator), module:Class or file.py:Class", optional=True),
        "env_args": Rule("a mapping of the env's keyword arguments", lambda v: isinstance(v, dict), ("x",)),
        "max_turns": at_least(1),
        "max_episode_tokens": at_least(1),
    }
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
    reward_timeout_s: float = 30.0     # seconds one reward call may take; past it the run stops naming the reward and the sample
    rewards: list[dict] = dataclasses.field(default_factory=list)   # weighted terms instead of task.reward: [{name: gsm8k, weight: 1.0}, {reward_model: DIR, weight: 0.5}]
    columns: dict[str, str] = dataclasses.field(default_factory=dict)   # dataset: {name the task/reward sees: column}, e.g. {prompt: question}
    split: str = "train"               # dataset: the split of a datasets save_to_disk DatasetDict folder to train on
    eval_path: str | None = None       # dataset: a separate held-out file or folder (task.eval_fraction then unused)
    eval_split: str = "test"           # dataset: the split of an eval_path DatasetDict folder
    shuffle: bool = False              # dataset: every pass over the train rows in a new order seeded by run.seed
    streaming: bool = False            # dataset: read task.path lazily (datasets streaming), for data larger than memory
    shuffle_buffer: int = 10000        # dataset, streaming with shuffle: rows in the shuffle buffer
    env: str | None = None             # multi-turn: an env name or module:Class / file.py:Class (docs/agents.md); None: one turn
    env_args: dict = dataclasses.field(default_factory=dict)   # env: keyword arguments of each episode's env
    max_turns: int = 4                 # env: model turns per episode at most
    max_episode_tokens: int = 256      # env: tokens after the prompt per episode at most (turns and observations)

    def validate(self):
        if self.name == "dataset" and not self.path:
            return "path is required when name is 'dataset' (task.path=data.jsonl)"
        if self.rewards and self.reward != "builtin":
            return "set task.reward (one reward) or task.rewards (weighted terms), not both (task.reward=builtin unsets it)"
        for i, entry in enumerate(self.rewards):
            problem = term_problem(entry)
            if problem:
                return f"rewards[{i}] {problem}"
        for key, field_name in (("prompt", "prompt_field"), ("answer", "answer_field")):
            if key in self.columns and getattr(self, field_name) != key:
                return f"columns.{key} and {field_name} both name the {key} column: set one"
        if self.min_digits > self.max_digits:
            return f"min_digits ({self.min_digits}) must be <= max_digits ({self.max_digits})"
        if self.env is not None and (self.reward != "builtin" or self.rewards):
            return ("reward and rewards are not read with task.env (the env's rewards score the episode); remove "
                    "them")


@dataclasses.dataclass
class RolloutSection:
    CHECKS: ClassVar[dict[str, Rule]] = {
        "prompts_per_step": at_least(1),
        "samples_per_prompt": at_least(1),
        "max_new_tokens": at_least(1),
        "temperature": greater_than(0),
        "top_p": within(0, 1, low_open=True),
        "top_k": at_least(0),
        "min_p": within(0, 1),
        "logprobs": checked_by_type("full or sampled"),
        "page_size": at_least(1),
        "max_num_seqs": at_least(1),
        "max_num_batched_tokens": at_least(1),
        "kv_cache_bytes": at_least(1, optional=True),
        "engine": non_empty("a rollout engine name"),
        "decode_graphs": one_of("auto", "on", "off"),
        "overlap": one_of("auto", "on", "off"),
        "record_routing": checked_by_type("true or false"),
        "ignore_eos": checked_by_type("true or false"),
        "share_weights": checked_by_type("true, false or null"),
        "async_steps": at_least(0),
        "max_staleness": at_least(0, optional=True),
        "partial_tokens": at_least(0),
    }
    GUARDS: ClassVar[dict[str, Rule]] = {"temperature": usual(0, 10, (11.0, 1e9), low_open=True)}
    prompts_per_step: int = 32         # prompts (groups) per optimizer step
    samples_per_prompt: int = 8        # completions per prompt (the GRPO group size)
    max_new_tokens: int = 6            # completion length limit (longer ones are truncated)
    ignore_eos: bool = False           # sample past <eos>: every completion is max_new_tokens long (vLLM's ignore_eos)
    temperature: float = 1.0           # sampling temperature (the trainer scores at the same one)
    top_p: float = 1.0                 # nucleus sampling (1.0: off)
    top_k: int = 0                     # top-k sampling (0: off)
    min_p: float = 0.0                 # min-p sampling (0.0: off; vLLM's, applied before top-k / top-p)
    logprobs: Literal["full", "sampled"] = "full"   # full softmax | the kept set's renormalised distribution (strict)
    page_size: int = 16                # KV-cache page size in tokens
    max_num_seqs: int = 512            # sequences decoded at once
    max_num_batched_tokens: int = 8192 # token budget of one engine step (chunked prefill)
    kv_cache_bytes: int | None = None  # KV-cache size; None: sized from the batch
    engine: str = "rlalign"            # which rollout engine (rlalign.train.engines.ENGINES)
    decode_graphs: str = "auto"        # CUDA-graph decode steps (RolloutConfig.decode_graphs): auto | on | off
    overlap: str = "auto"              # overlapped scheduling of decode steps (RolloutConfig.overlap): auto | on | off
    record_routing: bool = True        # MoE models: the engine records expert choices for moe/routing_* (dense: ignored)
    share_weights: bool | None = None  # the engine reads the policy's own tensors (no copy); None: where possible
    async_steps: int = 0               # generate up to k steps ahead while the trainer trains (docs/async.md); 0: synchronous
    max_staleness: int | None = None   # most weight versions a sample may lag the trainer (None: async_steps)
    partial_tokens: int = 0            # async: a sample's tokens after its first N sampled by the next version (0: off)

    def validate(self):
        if self.partial_tokens and not self.async_steps:
            return (f"partial_tokens={self.partial_tokens} cuts the samples generated ahead at a weight update: it "
                    "needs async_steps >= 1 (docs/async.md)")
        if self.partial_tokens >= self.max_new_tokens:
            return (f"partial_tokens={self.partial_tokens} cuts no sample (max_new_tokens={self.max_new_tokens}): "
                    "set it below max_new_tokens, or 0 for whole rollouts")
        if self.max_staleness is not None and self.async_steps > self.max_staleness:
            return (f"async_steps={self.async_steps} would train on samples {self.async_steps} versions old, more "
                    f"than max_staleness={self.max_staleness}: lower async_steps or raise max_staleness")
        if (self.logprobs == "sampled" or self.min_p) and self.engine != "rlalign":
            return (f"logprobs=sampled and min_p need engine=rlalign (engine {self.engine!r} samples without min-p "
                    "and reports full-softmax log-probs)")
        if self.engine not in ENGINES:
            return f"engine must be one of {sorted(ENGINES)}, got {self.engine!r} ({INTEGRATIONS_HINT})"
        return memory_problem("prompts_per_step x samples_per_prompt (per step)",
                              self.prompts_per_step * self.samples_per_prompt, self.max_new_tokens)

    @property
    def logprob_temperature(self) -> float:
        """The temperature the trainer scores rollout tokens at: the rollout engine's reported-logprob
        temperature for a sample drawn at ``temperature`` (the one rule, ops.logprob_temperature)."""
        from rlalign.ops import temperature as temperature_rule   # lazy: the config is read before torch is needed
        return temperature_rule.logprob_temperature(self.temperature)

    @property
    def sampled_scoring(self) -> "dict | None":
        """``ops.sampled_logprob``'s settings with ``logprobs=sampled`` (the distribution the engine drew from:
        temperature, top_k, top_p, min_p), None with ``logprobs=full`` (the full softmax at the logprob
        temperature)."""
        if self.logprobs != "sampled":
            return None
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


@dataclasses.dataclass
class AlgoSection:
    """The algorithm (rlalign.algos.registry): a key the chosen algorithms do not read is refused when set.
    ``None`` for clip_low / clip_high: the chosen policy loss's own default (ppo_clip 0.2 / 0.28)."""
    CHECKS: ClassVar[dict[str, Rule]] = {
        **{k: checked_by_type("one of its listed names") for k in
           ("advantage", "policy_loss", "loss_agg", "kl_estimator", "mismatch_correction", "turn_advantage")},
        **{k: checked_by_type("true or false") for k in
           ("kl_in_reward", "dynamic_sampling", "overlong_filter")},
        "clip_low": within(0, 1, high_open=True, optional=True),
        "clip_high": at_least(0, optional=True, what="a finite number"),
        "dual_clip": greater_than(1, optional=True),
        "kl_coef": at_least(0, what="a finite number"),
        "entropy_coef": at_least(0, what="a finite number"),
        "router_aux_coef": at_least(0, what="a finite number"),
        "max_draw_rounds": at_least(1),
        "mismatch_cap": greater_than(0),
        "ppo_epochs": at_least(1),
        "mini_batches": at_least(1),
        "gamma": within(0, 1),
        "lam": within(0, 1),
        "value_lr": greater_than(0),
        "value_clip": greater_than(0, optional=True),
        "vtrace_rho_cap": greater_than(0),
        "vtrace_c_cap": greater_than(0),
    }
    GUARDS: ClassVar[dict[str, Rule]] = {
        "value_lr": usual(0, 1, (2.0, 1e9), low_open=True),
        "kl_coef": usual(0, 10, (11.0, 1e6)),
        "entropy_coef": usual(0, 1, (1.5, 100.0)),
        "router_aux_coef": usual(0, 1, (1.5, 100.0)),
    }
    advantage: Literal[ADVANTAGES.names()] = "grpo"       # advantage estimator (gae: PPO with a value model)
    turn_advantage: Literal["episode", "turn"] = "episode"   # grpo, dr_grpo, rloo with task.env: per episode | per turn (return-to-go, docs/agents.md)
    policy_loss: Literal[POLICY_LOSSES.names()] = "ppo_clip"   # surrogate objective
    clip_low: float | None = None      # ratio clip below, 1 - clip_low (unset: the loss's own default)
    clip_high: float | None = None     # ratio clip above, 1 + clip_high (unset: the loss's default; ppo_clip 0.28, DAPO clip-higher)
    dual_clip: float | None = None     # ppo_clip: dual-clip bound for negative advantages, e.g. 3.0
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"   # loss aggregation over tokens and sequences
    kl_coef: float = 0.0               # KL-to-reference penalty weight (0: no reference model)
    kl_estimator: Literal[KL_ESTIMATOR_REGISTRY.names()] = "k3"   # KL estimator of the penalty
    kl_in_reward: bool = False         # fold the KL penalty into the reward instead of the loss
    entropy_coef: float = 0.0          # entropy bonus weight
    router_aux_coef: float = 0.0       # MoE models: weight of the routers' load-balancing loss (Qwen3-MoE formula)
    dynamic_sampling: bool = False     # DAPO: drop zero-variance groups, draw more
    max_draw_rounds: int = 3           # dynamic_sampling: most draws per step
    overlong_filter: bool = False      # mask truncated completions
    mismatch_correction: Literal[MISMATCH_CORRECTIONS.names()] = "none"   # importance-sampling correction (native profile)
    mismatch_cap: float = 2.0          # TIS cap C / MIS upper bound
    ppo_epochs: int = 1                # optimizer passes over each step's samples
    mini_batches: int = 1              # optimizer steps per epoch over the step's samples (verl's ppo_mini_batch_size)
    gamma: float = 1.0                 # gae, reinforce_pp: discount
    lam: float = 0.95                  # gae: lambda
    value_lr: float = 1e-3             # gae: AdamW lr of the value model
    value_clip: float | None = 0.2     # gae: PPO2 value clipping around the old values
    vtrace_rho_cap: float = 1.0        # gae with rollout.async_steps > 0: V-trace's rho truncation (value targets)
    vtrace_c_cap: float = 1.0          # gae with rollout.async_steps > 0: V-trace's trace truncation c

    def validate(self):
        defaults = {f.name: f.default for f in dataclasses.fields(AlgoSection)}
        return refused_setting(dataclasses.asdict(self), defaults)


@dataclasses.dataclass
class OptimSection:
    CHECKS: ClassVar[dict[str, Rule]] = {
        "lr": greater_than(0),
        "weight_decay": at_least(0, what="a finite number"),
        "betas": pair_within(0, 1),
        "warmup_steps": at_least(0),
        "min_lr_ratio": within(0, 1),
        "grad_clip": greater_than(0),        # a negative max-norm would flip the gradient's sign
        "micro_batch_tokens": at_least(1),
        "activation_checkpointing": checked_by_type("true or false"),
        "master_weights": checked_by_type("true or false"),
        "offload": checked_by_type("true or false"),
        "step_chunk_elements": at_least(1),
    }
    GUARDS: ClassVar[dict[str, Rule]] = {
        "lr": usual(0, 1, (2.0, 1e9), low_open=True),
        "weight_decay": usual(0, 1, (1.5, 100.0)),
    }
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
    step_chunk_elements: int = 67108864   # the optimizer step's working set: this many elements at a time (same bits)


@dataclasses.dataclass
class RunSection:
    CHECKS: ClassVar[dict[str, Rule]] = {
        "dir": non_empty("a directory path", optional=True),
        "steps": at_least(1),
        "seed": within(0, 2**63 - 1),
        "profile": checked_by_type("strict, native or portable"),
        "on_mismatch": checked_by_type("warn or stop"),
        "eval_every": at_least(1),
        "eval_samples": at_least(1),
        "checkpoint_every": at_least(1),
        **{k: checked_by_type("true or false") for k in ("resume", "overwrite", "progress", "policy_kl",
                                                          "verify_behaviour")},
        "resume_override": Rule("a list of section.key names", lambda x: all(isinstance(k, str) and k.strip() for k in x),
                                ([""], "bogus")),
        "log_every": at_least(1),
        "loggers": Rule(f"a list of {', '.join(LOGGERS)}", lambda x: all(n in LOGGERS for n in x), (["bogus"], "bogus")),
        "metric_names": checked_by_type("rlalign, verl or trl"),
        "keep_checkpoints": at_least(1),
        "save_checkpoints": checked_by_type("true or false"),
        "check_memory": checked_by_type("true or false"),
        "max_minutes": greater_than(0, optional=True),
        "stop_at_step": at_least(1, optional=True),
        "stop_when_stalled": at_least(1, optional=True),
        "allow_unusual": Rule("a list of section.key names", lambda x: all(isinstance(k, str) and k.strip() for k in x),
                              ([""], "bogus")),
    }
    dir: str | None = None             # default: runs/<timestamp>
    steps: int = 120                   # optimizer steps of the run
    seed: int = 0                      # seed of the data order and the sampling
    profile: Literal["strict", "native", "portable"] = "strict"   # strict: bit-identical logprobs; native: vendor kernels;
    # portable: strict across CPU and GPU (dense full fine-tuning on one process; an audit mode, docs/portable.md)
    on_mismatch: Literal["warn", "stop"] = "warn"     # strict profile: what a train/rollout mismatch does
    eval_every: int = 10               # held-out eval every N steps (and at the last)
    eval_samples: int = 2              # samples per held-out problem for eval/accuracy (at the rollout temperature)
    checkpoint_every: int = 20         # checkpoint every N steps (and at the last)
    resume: bool = False               # continue the run in run.dir from its latest checkpoint and saved config.yaml
    resume_override: list[str] = dataclasses.field(default_factory=list)   # keys a resume may change that alter the run's meaning
    overwrite: bool = False            # a fresh run may replace the files of a previous run in run.dir
    progress: bool = True              # live progress bar (on a terminal only)
    log_every: int = 1                 # one plain log line every N steps
    verify_behaviour: bool = False     # recompute each step's behaviour log-probs with the recorded version's weights (bitwise check)
    policy_kl: bool = False            # log kl/policy_step, k3 KL(pi_before || pi_after) of each update (one extra forward)
    loggers: list[str] = dataclasses.field(default_factory=lambda: ["jsonl"])   # jsonl (always) | tensorboard | wandb
    metric_names: Literal["rlalign", "verl", "trl"] = "rlalign"   # metric names in tensorboard / wandb
    keep_checkpoints: int = 2          # newest checkpoints kept in run.dir/checkpoints
    save_checkpoints: bool = True      # false: no checkpoint at all, not even the last (a state too large for the disk)
    check_memory: bool = True          # refuse, before loading, a run whose memory budget exceeds the GPU or host (rlalign.train.budget)
    max_minutes: float | None = None   # stop (after a checkpoint) when exceeded
    stop_at_step: int | None = None    # stop (after a checkpoint) after this step; the lr schedule still spans run.steps
    stop_when_stalled: int | None = None   # end the run after N steps in a row with every advantage 0 (rlalign/train/stall.py)
    allow_unusual: list[str] = dataclasses.field(default_factory=list)   # keys whose value may lie outside its usual range, e.g. [optim.lr] (docs/training.md)


@dataclasses.dataclass
class RaySection:
    """``launcher=ray``: the trainer and the rollout workers run as Ray actors (docs/ray.md)."""
    CHECKS: ClassVar[dict[str, Rule]] = {
        "address": non_empty("auto, HOST:PORT or ray://HOST:PORT", optional=True),
        "num_rollout_workers": at_least(1),
        "cpus_per_actor": greater_than(0),
        "gpus_per_actor": at_least(0, what="a finite number"),
        "weight_sync": checked_by_type("auto, object_store or broadcast"),
    }
    address: str | None = None         # None: start a local cluster; "auto", "HOST:6379" or "ray://HOST:10001": join one
    num_rollout_workers: int = 2       # rollout engine actors
    cpus_per_actor: float = 1.0        # Ray CPUs of the trainer and of each worker (also its torch threads)
    gpus_per_actor: float = 0.0        # 1 with model.device=cuda
    weight_sync: Literal["auto", "object_store", "broadcast"] = "auto"   # auto: broadcast on cuda (NCCL), object store on cpu


@dataclasses.dataclass
class ParallelSection:
    """Trainer parallelism (docs/distributed.md); dp * tp processes (gloo on CPU, NCCL on GPU), spawned by
    ``rlalign train parallel.dp=2`` or started by torchrun (WORLD_SIZE must equal dp * tp). dp: each rank
    back-propagates a share of the step's micro-batches and a deterministic all-reduce sums the gradients. tp: the
    policy is sharded (rlalign.distributed.parallelize); None keeps the unsharded model, 1/2/4/8 use the canonical
    partitions, and every tp gives the same bits as tp=1. shard: ``grads`` shards the fp32 masters, the AdamW state
    and the reduced gradients over the dp ranks (rlalign.train.sharding), ``params`` the training weights too (each
    decoder layer gathered for its forward and backward: rlalign.train.weight_shards); both bit for bit the ``none``
    run."""
    CHECKS: ClassVar[dict[str, Rule]] = {
        "dp": at_least(1),
        "tp": one_of(1, 2, 4, 8, optional=True),
        "shard": one_of(*SHARD_MODES),
    }
    dp: int = 1                        # data-parallel trainer processes
    tp: int | None = None              # tensor-parallel degree (None: unsharded)
    shard: str = "none"                # none | grads: masters, AdamW state and reduced gradients split over the dp ranks
                                       # | params: and the training weights (gathered per decoder layer when used)

    def refusal(self, cfg) -> "str | None":
        """What ``shard=grads`` / ``shard=params`` cannot run with (``cfg``: the whole TrainConfig), in one line; None:
        nothing."""
        if self.shard == "none":
            return None
        if self.dp < 2:
            return (f"parallel.shard={self.shard} splits the training state over the data-parallel ranks: set "
                    "parallel.dp >= 2")
        refused = (
            (self.tp is not None, "parallel.tp"), (cfg.optim.offload, "optim.offload=true"),
            (cfg.rollout.async_steps > 0, "rollout.async_steps > 0"),
            (cfg.algo.advantage == "gae", "the PPO value model (algo.advantage=gae)"),
        )
        if self.shard == "params":   # the weights exist whole only per layer, inside the step
            refused += (
                (cfg.model.lora.rank > 0, "model.lora (the frozen base is not sharded: use parallel.shard=grads)"),
                (cfg.rollout.decode_graphs == "on", "rollout.decode_graphs=on (each rollout gathers the weights "
                                                     "into new storage; a CUDA graph holds the old addresses)"),
                (cfg.run.verify_behaviour, "run.verify_behaviour"),
            )
        what = next((name for bad, name in refused if bad), None)
        return (None if what is None else
                f"parallel.shard={self.shard} with {what} is not supported yet; use parallel.shard=none")

    @property
    def world_size(self) -> int:
        return self.dp * (self.tp or 1)


@dataclasses.dataclass
class TrainConfig:
    CHECKS: ClassVar[dict[str, Rule]] = {"launcher": checked_by_type("local or ray")}
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
        portable = self._portable_refusal()
        if portable:
            return portable
        if self.parallel.world_size > 1 and self.launcher != "local":
            return f"parallel.dp/tp > 1 run with launcher=local (got launcher={self.launcher})"
        if self.task.env is not None and self._env_refusal():
            return self._env_refusal()
        turns = self._turn_advantage_problem()
        if turns:
            return turns
        if self.parallel.tp is not None and self.algo.advantage == "gae":
            return "parallel.tp does not support the PPO value model (algo.advantage=gae) yet"
        sampled = self._sampled_logprobs_problem()
        if sampled:
            return sampled
        lora = self.model.lora.conflict(self)
        if lora:
            return lora
        shard = self.parallel.refusal(self)
        if shard:
            return shard
        if self.run.resume and self.run.overwrite:
            return "run.resume=true continues the run in run.dir and run.overwrite=true replaces it: choose one"
        unusual = self._unusual_value()
        if unusual:
            return unusual
        evals = memory_problem("task.eval_size x run.eval_samples (per evaluation)",
                               self.task.eval_size * self.run.eval_samples, self.rollout.max_new_tokens)
        if evals:
            return evals
        if self.algo.advantage in GROUP_BASELINES and self.rollout.samples_per_prompt < 2:
            return (f"algo.advantage={self.algo.advantage} compares the samples of a prompt: with "
                    "rollout.samples_per_prompt=1 every advantage is 0 and training does nothing; use >= 2")


    def _portable_refusal(self) -> "str | None":
        """``run.profile=portable`` trains dense decoders, full fine-tuning, on one process (docs/portable.md): one line
        for each combination its backward or its fixed-order step does not cover."""
        if self.run.profile != "portable":
            return None
        unsupported = [(self.model.lora.rank > 0, "model.lora (LoRA training)"),
                       (self.parallel.world_size > 1, "parallel.dp / parallel.tp"),
                       (self.launcher != "local", f"launcher={self.launcher}"),
                       (self.optim.offload, "optim.offload=true"),
                       (self.optim.activation_checkpointing, "optim.activation_checkpointing=true"),
                       (self.algo.advantage == "gae", "algo.advantage=gae (the value model)"),
                       (self.rollout.engine != "rlalign", f"rollout.engine={self.rollout.engine}"),
                       (self.rollout.async_steps > 0, "rollout.async_steps > 0")]
        for bad, what in unsupported:
            if bad:
                return (f"run.profile=portable does not train with {what}: it covers full fine-tuning of dense "
                        "decoders on one process (docs/portable.md); use run.profile=strict")
        return None

    def _sampled_logprobs_problem(self) -> "str | None":
        """``rollout.logprobs=sampled`` recomputes the engine's kept set from the policy's full logits rows, bit for
        bit: strict, unsharded; and one optimizer step per rollout step, the only pass whose policy is the
        engine's (a moved policy may drop a sampled token from its kept set: log-prob -inf)."""
        if self.rollout.logprobs != "sampled":
            return None
        if self.run.profile != "strict" or self.parallel.tp is not None:
            return ("rollout.logprobs=sampled needs run.profile=strict and no parallel.tp (the kept set is recomputed "
                    "from the full logits row, bit for bit)")
        if self.algo.mini_batches != 1 or self.algo.ppo_epochs != 1 or self.run.policy_kl:
            return ("rollout.logprobs=sampled needs algo.mini_batches=1, algo.ppo_epochs=1 and run.policy_kl=false: "
                    "a policy moved by an optimizer step may drop a sampled token from its kept set (log-prob -inf)")
        if self.rollout.async_steps:
            return ("rollout.logprobs=sampled needs rollout.async_steps=0: a sample drawn by older weights may lie "
                    "outside the current policy's kept set (log-prob -inf)")
        return None

    def _turn_advantage_problem(self) -> "str | None":
        """``algo.turn_advantage=turn`` gives each turn of a multi-turn episode its return-to-go's advantage: it needs
        episodes, and returns without a KL penalty folded in (the penalty is per episode)."""
        if self.algo.turn_advantage != "turn":
            return None
        if self.task.env is None:
            return "algo.turn_advantage=turn needs multi-turn episodes (task.env); one-turn samples have one turn each"
        if self.algo.kl_in_reward:
            return ("algo.turn_advantage=turn does not fold the KL penalty into the turns' returns yet; use "
                    "algo.kl_in_reward=false (the penalty in the loss)")
        return None

    def _env_refusal(self) -> "str | None":
        """Multi-turn episodes (task.env) run on rlalign's engine in one trainer process (docs/agents.md)."""
        if self.rollout.engine != "rlalign":
            return (f"task.env in rlalign train needs rollout.engine=rlalign (got {self.rollout.engine}); the vLLM "
                    "engine runs episodes from Python through rlalign.envs.run_episodes")
        if self.launcher != "local" or self.parallel.dp > 1:
            return "task.env runs with launcher=local and parallel.dp=1 (multi-turn rollouts are not sharded yet)"
        return None

    def _unusual_value(self) -> "str | None":
        """A value outside its usual range (the sections' GUARDS) that run.allow_unusual does not list as meant."""
        guarded = guarded_keys(TrainConfig)
        stray = [k for k in self.run.allow_unusual if k not in guarded]
        if stray:
            return (f"run.allow_unusual names {', '.join(stray)}, which has no usual range; the keys with one: "
                    f"{', '.join(guarded)}")
        return unusual_value(self, self.run.allow_unusual, "run.allow_unusual")


# Advantages measured against the other samples of the same prompt (one sample: always 0).
GROUP_BASELINES = ("grpo", "dr_grpo", "rloo")
# Host memory a step's sequences take in Python lists (tokens, logprobs, text): a generous estimate.
SEQUENCE_BYTES, TOKEN_BYTES = 2048, 256


def host_memory_bytes() -> "int | None":
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def memory_problem(what: str, sequences: int, max_new_tokens: int, fix: str = "lower them") -> "str | None":
    """Sequences that would not fit in half of this machine's memory are refused before any work (instead of
    hanging while their prompt list is built, or running until killed): the trainer's step and evaluation,
    and ``rlalign generate``'s completions."""
    need = sequences * (SEQUENCE_BYTES + TOKEN_BYTES * max_new_tokens)
    have = host_memory_bytes()
    if have is None:
        return None
    if need > have // 2:
        return (f"{what} = {sequences} sequences would take about {need / 2**30:.0f} GiB of host memory (estimated "
                f"{SEQUENCE_BYTES} B + {TOKEN_BYTES} B per new token each), more than half of this machine's "
                f"{have / 2**30:.0f} GiB; {fix}")
    return None
