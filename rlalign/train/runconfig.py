"""The config is part of the run: ``RUN_DIR/config.yaml`` (resolved, every key) and the resume rules.

- A run writes ``config.yaml`` (atomically) before its first step; a resumed run rewrites it with
  what it continues under.
- ``rlalign train run.dir=D run.resume=true`` starts from ``D/config.yaml``: the task, reward, model
  and every other key need not be repeated; keys given on the command line override it.
- A resume that changes a key that alters what the run optimises (model, task, reward, rollout
  sampling, algorithm, optimizer, micro-batching, seed, profile) is refused with the keys named,
  unless ``run.resume_override=[key, ...]`` lists them. Keys that only change how the run is
  executed, watched or how long it goes (:data:`RESUME_FREE`) may change freely.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from rlalign.configlib import ConfigError, flatten, load_config, load_raw, load_yaml, merge
from rlalign.train.config import TrainConfig
from rlalign.train.runio import atomic_write

CONFIG_FILE = "config.yaml"

# Keys a resume may change without altering the optimisation the run performs. run.steps extends
# (or shortens) the run; the cosine lr schedule is then taken over the new total.
RESUME_FREE_PREFIXES = ("ray.", "parallel.")
RESUME_FREE = frozenset({
    "launcher", "run.dir", "run.steps", "run.resume", "run.resume_override", "run.overwrite", "run.progress", "run.log_every", "run.policy_kl",
    "run.loggers", "run.metric_names", "run.keep_checkpoints", "run.save_checkpoints", "run.max_minutes", "run.stop_at_step", "run.stop_when_stalled", "run.on_mismatch",
    "run.eval_every", "run.eval_samples", "run.checkpoint_every", "rollout.page_size", "rollout.max_num_seqs",
    "rollout.max_num_batched_tokens", "rollout.kv_cache_bytes", "rollout.decode_graphs", "rollout.overlap",
    "rollout.record_routing", "rollout.share_weights",
    "optim.activation_checkpointing", "optim.offload", "optim.step_chunk_elements", "task.eval_size",
})


def config_yaml(cfg: TrainConfig) -> str:
    import dataclasses
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, default_flow_style=False)


def write_run_config(run_dir: Path, cfg: TrainConfig) -> Path:
    path = Path(run_dir) / CONFIG_FILE
    atomic_write(path, config_yaml(cfg).encode())
    return path


def read_run_config(run_dir: Path) -> "dict | None":
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML ({exc.__class__.__name__}); restore it or delete it "
                          "and repeat the run's keys on the command line") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a mapping of sections; restore it")
    return data


def resolve_train_config(path: "str | None", overrides: list[str]) -> TrainConfig:
    """The command line's config; on ``run.resume=true`` laid over the run directory's saved config.yaml."""
    cfg = load_config(TrainConfig, path, overrides)
    if not cfg.run.resume or not cfg.run.dir:
        return cfg
    saved = read_run_config(Path(cfg.run.dir))
    if saved is None:
        return cfg
    given = load_raw(path, overrides)
    given.setdefault("run", {})["resume"] = True
    # run.resume_override is this invocation's choice: a previous resume's list is not carried over
    base = {**saved, "run": {k: v for k, v in saved.get("run", {}).items() if k != "resume_override"}}
    return load_config(TrainConfig, None, None, base=merge(base, given))


def check_resume(saved: dict, cfg: TrainConfig) -> list[str]:
    """Raise when ``cfg`` changes a key of the saved run that alters its meaning and that
    ``run.resume_override`` does not list; returns the changed keys that were allowed."""
    old = flatten(saved)
    new = flatten(cfg)
    unknown = [k for k in cfg.run.resume_override if k not in new]
    if unknown:
        raise ConfigError(f"run.resume_override names unknown keys {unknown}; give section.key names, e.g. "
                          "run.resume_override=[optim.lr]")
    changed = [k for k in new if k in old and old[k] != new[k] and k not in RESUME_FREE
               and not k.startswith(RESUME_FREE_PREFIXES)]
    refused = [k for k in changed if k not in cfg.run.resume_override]
    if refused:
        diff = ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in refused)
        raise ConfigError(f"run.resume=true would change what the run optimises ({diff}); resume without changing "
                          f"them (config.yaml in the run directory holds the run's values), or allow it with "
                          f"run.resume_override=[{','.join(refused)}]")
    return changed


__all__ = ["CONFIG_FILE", "RESUME_FREE", "config_yaml", "write_run_config", "read_run_config",
           "resolve_train_config", "check_resume"]
