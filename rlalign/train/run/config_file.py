"""The config is part of the run: ``RUN_DIR/config.yaml`` (resolved, every key) and the resume rules.

- A run writes ``config.yaml`` (atomically) before its first step; a resumed run rewrites it with
  what it continues under.
- ``rlalign train run.dir=D run.resume=true`` starts from ``D/config.yaml``: the task, reward, model
  and every other key need not be repeated; keys given on the command line override it.
- A resume that changes a key that alters what the run optimises (model, task, reward, rollout
  sampling, algorithm, optimizer, micro-batching, seed, profile) is refused with the keys named,
  unless ``run.resume_override=[key, ...]`` lists them. Keys that only change how the run is
  executed, watched or how long it goes (:data:`RESUME_FREE`, an explicit allow-list) may change
  freely. The comparison is against the config stored in the checkpoint (every key, as the run
  used it), not against ``config.yaml``: editing or deleting a key there changes nothing.

Reward code (``task.reward`` as ``file.py:function`` or ``module:function``) and the run directory:

- A reward file inside ``run.dir`` is never imported: a run directory holds data only.
- A run records its reward file (absolute path and sha256) in every checkpoint and in
  ``checkpoints/latest.json``. A resume imports the reward only if this command names it (on the
  command line, or in a config file outside the run directory), or, when only the run's
  ``config.yaml`` names it, if it is a ``.py`` file whose sha256 is the one the run recorded. A
  ``module:function`` reward named only by ``config.yaml`` is refused (its code cannot be checked
  before it is imported): name it again.
- A named reward file whose sha256 differs from the recorded one is refused at the resume (the run
  would optimise a different reward) unless ``run.resume_override=[task.reward]``.

An environment (``task.env`` as ``file.py:Class`` or ``module:Class``, docs/agents.md) is code too: a file inside
``run.dir`` is never imported, and a resume imports it only if this command names it (no fingerprint is recorded
for envs: ``config.yaml`` alone never chooses an env to run).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from rlalign.configlib import ConfigError, flatten, load_config, load_raw, load_yaml, merge
from rlalign.envs.loading import env_is_code, env_source_file
from rlalign.tasks.registry import reward_is_code, reward_source_file
from rlalign.train.config import TrainConfig
from rlalign.models.atomic import atomic_write
from rlalign.train.run.checkpoint_files import CheckpointCorrupt, MANIFEST_FILE, file_sha256, read_manifest

CONFIG_FILE = "config.yaml"

# Keys a resume may change without altering the optimisation the run performs. run.steps extends
# (or shortens) the run; the cosine lr schedule is then taken over the new total.
RESUME_FREE_PREFIXES = ("ray.", "parallel.")
RESUME_FREE = frozenset({
    "launcher", "run.dir", "run.steps", "run.resume", "run.resume_override", "run.overwrite", "run.progress", "run.log_every", "run.policy_kl",
    "run.verify_behaviour",
    "run.loggers", "run.metric_names", "run.keep_checkpoints", "run.save_checkpoints", "run.max_minutes", "run.stop_at_step", "run.stop_when_stalled", "run.on_mismatch",
    "run.eval_every", "run.eval_samples", "run.checkpoint_every", "rollout.page_size", "rollout.max_num_seqs",
    "rollout.max_num_batched_tokens", "rollout.kv_cache_bytes", "rollout.decode_graphs", "rollout.overlap",
    "rollout.record_routing", "rollout.share_weights",
    "optim.activation_checkpointing", "optim.offload", "optim.step_chunk_elements", "task.eval_size",
    "task.reward_timeout_s", "run.allow_unusual",
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
    """The command line's config; on ``run.resume=true`` laid over the run directory's saved config.yaml
    (whose reward code is imported only as the module doc says)."""
    cfg = load_config(TrainConfig, path, overrides)
    refuse_reward_in_run_dir(cfg)
    if not cfg.run.resume or not cfg.run.dir:
        return cfg
    saved = read_run_config(Path(cfg.run.dir))
    if saved is None:
        return cfg
    given = load_raw(path, overrides)
    given.setdefault("run", {})["resume"] = True
    # run.resume_override is this invocation's choice: a previous resume's list is not carried over
    base = {**saved, "run": {k: v for k, v in saved.get("run", {}).items() if k != "resume_override"}}
    cfg = load_config(TrainConfig, None, None, base=merge(base, given))
    refuse_reward_in_run_dir(cfg)
    if not _names_reward(path, overrides, Path(cfg.run.dir)):
        refuse_unrecorded_reward(cfg)
    if not _names_reward(path, overrides, Path(cfg.run.dir), key="rewards"):
        refuse_saved_reward_terms(cfg)
    if env_is_code(cfg.task.env) and not _names_reward(path, overrides, Path(cfg.run.dir), "env"):
        raise ConfigError(f"run.resume=true: task.env={cfg.task.env} is code, and only {cfg.run.dir}/config.yaml names "
                          f"it; a run directory never chooses code to run: name it on the command line "
                          f"(task.env={cfg.task.env}) or in a config file outside the run directory")
    return cfg


def _names_reward(path: "str | None", overrides: list[str], run_dir: Path, key: str = "reward") -> bool:
    """Whether this command names task.<key> (task.reward, task.rewards) itself: on the command line, or in a config
    file that does not lie inside the run directory."""
    if key in (load_raw(None, overrides).get("task") or {}):
        return True
    return path is not None and not _inside(Path(path), run_dir) and key in (load_raw(path).get("task") or {})


def _term_specs(cfg: TrainConfig) -> list[str]:
    return [t["name"] for t in cfg.task.rewards if isinstance(t, dict) and isinstance(t.get("name"), str)]


def refuse_saved_reward_terms(cfg: TrainConfig) -> None:
    """A resume whose task.rewards names reward code only through the run directory's config.yaml: refused (a run
    directory never chooses code to run; task.rewards' files have no recorded sha256 to compare)."""
    code = [spec for spec in _term_specs(cfg) if reward_is_code(spec)]
    if code:
        raise ConfigError(f"run.resume=true: task.rewards names reward code ({', '.join(code)}) that only "
                          f"{cfg.run.dir}/config.yaml names; a run directory never chooses code to run: repeat "
                          "task.rewards on the command line or in a config file outside the run directory")


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def refuse_reward_in_run_dir(cfg: TrainConfig) -> None:
    """A reward (or env) file inside run.dir is never imported: a run directory holds data, never code that runs."""
    for key, spec in [("task.reward", cfg.task.reward), *(("task.rewards", s) for s in _term_specs(cfg))]:
        file = reward_source_file(spec)
        if file is not None and cfg.run.dir and _inside(file, Path(cfg.run.dir)):
            raise ConfigError(f"{key}={spec}: the file lies inside run.dir {cfg.run.dir}, and nothing in a run "
                              "directory runs as code; keep the reward file outside it")
    env_file = env_source_file(cfg.task.env)
    if env_file is not None and cfg.run.dir and _inside(env_file, Path(cfg.run.dir)):
        raise ConfigError(f"task.env={cfg.task.env}: the file lies inside run.dir {cfg.run.dir}, and nothing in a run "
                          "directory runs as code; keep the env file outside it")


def reward_fingerprint(spec: str) -> "dict | None":
    """{spec, file (absolute), sha256} of a ``file.py:function`` reward, recorded with every checkpoint;
    None for a built-in or ``module:function`` reward, or a file that is not there (loading names that)."""
    file = reward_source_file(spec)
    if file is None or not file.is_file():
        return None
    return {"spec": spec, "file": str(file.resolve()), "sha256": file_sha256(file)}


def recorded_reward(run_dir: Path) -> "dict | None":
    """The reward fingerprint ``checkpoints/latest.json`` records (None: none recorded, or no readable manifest)."""
    try:
        manifest = read_manifest(Path(run_dir) / "checkpoints" / MANIFEST_FILE, missing_ok=True)
    except CheckpointCorrupt:
        return None
    reward = ((manifest or {}).get("facts") or {}).get("reward")
    return reward if isinstance(reward, dict) else None


def refuse_unrecorded_reward(cfg: TrainConfig) -> None:
    """A resume whose reward code only the run directory's config.yaml names: import it only if it is the file
    the run recorded (same sha256); otherwise the user must name it."""
    spec = cfg.task.reward
    if not reward_is_code(spec):
        return
    again = (f"name it on the command line (task.reward={spec}) or in a config file outside the run directory to "
             "run it")
    if reward_source_file(spec) is None:
        raise ConfigError(f"run.resume=true: task.reward={spec} is code, and only {cfg.run.dir}/config.yaml names it; "
                          f"a run directory never chooses code to run: {again}")
    current, recorded = reward_fingerprint(spec), recorded_reward(Path(cfg.run.dir))
    if current is None or recorded is None or recorded.get("sha256") != current["sha256"]:
        why = ("is not there" if current is None else "has no sha256 recorded by the run" if recorded is None
               else "is not the file the run recorded (sha256 differs)")
        raise ConfigError(f"run.resume=true: task.reward={spec} comes only from {cfg.run.dir}/config.yaml and the file "
                          f"{why}; a run directory never chooses code to run: {again}")


def _same_reward_file(old_spec: str, new_spec: str, recorded: "dict | None", now: "dict | None") -> bool:
    """A reward file that moved (the run directory and its reward copied elsewhere) is the same reward: same
    function name, same sha256 as the one the run recorded."""
    return bool(recorded and now and recorded.get("sha256") == now["sha256"]
                and str(old_spec).rpartition(":")[2] == str(new_spec).rpartition(":")[2])


def check_resume(saved: dict, cfg: TrainConfig, recorded_reward_file: "dict | None" = None) -> list[str]:
    """Raise when ``cfg`` changes a key of the saved run (``saved``: the config stored in the checkpoint, every
    key) that alters its meaning and that ``run.resume_override`` does not list, naming each such key; also
    when the reward file's sha256 differs from ``recorded_reward_file`` (the checkpoint's); a reward file
    that only moved (same function, same sha256) is no change. Returns the changed keys that were allowed.
    A key the checkpoint does not hold (a field newer than the run) is not compared."""
    old = flatten(saved)
    new = flatten(cfg)
    unknown = [k for k in cfg.run.resume_override if k not in new]
    if unknown:
        raise ConfigError(f"run.resume_override names unknown keys {unknown}; give section.key names, e.g. "
                          "run.resume_override=[optim.lr]")
    reward_now = reward_fingerprint(cfg.task.reward)
    changed = [k for k in new if k in old and old[k] != new[k] and k not in RESUME_FREE
               and not k.startswith(RESUME_FREE_PREFIXES)
               and not (k == "task.reward" and _same_reward_file(old[k], new[k], recorded_reward_file, reward_now))]
    diffs = {k: f"{k}: {old[k]!r} -> {new[k]!r}" for k in changed}
    if recorded_reward_file and reward_now and recorded_reward_file.get("sha256") != reward_now["sha256"]:
        changed += [] if "task.reward" in changed else ["task.reward"]
        diffs["task.reward"] = (f"task.reward: the file {reward_now['file']} is not the one the run recorded (sha256 "
                                f"{str(recorded_reward_file.get('sha256'))[:12]}... -> {reward_now['sha256'][:12]}...)")
    refused = [k for k in changed if k not in cfg.run.resume_override]
    if refused:
        diff = ", ".join(diffs[k] for k in refused)
        raise ConfigError(f"run.resume=true would change what the run optimises ({diff}); resume without changing "
                          f"them (the checkpoint holds the run's values; config.yaml in the run directory lists "
                          f"them), or allow it with run.resume_override=[{','.join(refused)}]")
    return changed

def run_inputs(cfg: TrainConfig) -> list[Path]:
    """What a run reads from disk: the model folder (unless the embedded default), the dataset files, reward files,
    reward model folders and an env file. ``run.overwrite`` may not delete in a run directory holding one of them (run.directory.open_run_dir)."""
    reads = [Path(cfg.model.path)] if cfg.model.path != "default" else []
    reads += [Path(p) for p in (cfg.task.path, cfg.task.eval_path) if p]
    for spec in [cfg.task.reward, *(t.get("name") for t in cfg.task.rewards if isinstance(t, dict))]:
        reward = reward_source_file(spec) if spec else None
        if reward is not None:
            reads.append(reward)
    reads += [Path(t["reward_model"]) for t in cfg.task.rewards if isinstance(t, dict) and t.get("reward_model")]
    env_file = env_source_file(cfg.task.env)
    if env_file is not None:
        reads.append(env_file)
    return reads


__all__ = ["run_inputs", "CONFIG_FILE", "RESUME_FREE", "config_yaml", "write_run_config", "read_run_config",
           "resolve_train_config", "check_resume", "refuse_reward_in_run_dir", "refuse_unrecorded_reward",
           "reward_fingerprint", "recorded_reward"]
