"""``rlalign sft``: supervised fine-tuning on JSONL examples, in a run directory like ``rlalign train``'s.

:func:`run_sft` reads the examples (:mod:`~rlalign.train.sft.data`), holds out the eval rows, and takes one
optimizer step per batch (:mod:`~rlalign.train.sft.update`) in the strict profile by default. The run directory
follows ``rlalign train``'s rules (:mod:`rlalign.train.run`): one run at a time under its lock, a fresh run only
in an empty folder (``run.overwrite=true`` replaces a previous run's files and nothing else), ``config.yaml``,
``metrics.jsonl`` (step 0: the held-out loss before training; then per step ``loss/sft``, ``grad_norm``, ``lr``,
``tokens``, ``epoch``, times, and ``eval/loss`` every ``run.eval_every`` steps and at the last), checkpoints
every ``run.checkpoint_every`` steps and at the last, ``run.resume=true`` continuing bit for bit, and at the end
``policy/`` (Hugging Face format, tokenizer files copied: what ``rlalign train model.path=RUN_DIR/policy`` and
``rlalign generate --model RUN_DIR/policy`` start from) and ``report.png`` / ``report.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from rlalign.configlib import load_config, load_raw, merge
from rlalign.contract.profiles import use_profile
from rlalign.models.checkpoint import load_model_config, save_model
from rlalign.models.tokenizer import load_tokenizer
from rlalign.train.run.config_file import read_run_config, write_run_config
from rlalign.train.run.directory import open_run_dir
from rlalign.train.run.metrics import MetricsWriter
from rlalign.train.setup import load_policy, resolve_model_dir
from rlalign.train.sft import state
from rlalign.train.sft.config import SFTConfig
from rlalign.train.sft.data import SFTDataError, file_sha256, held_out_split, load_examples
from rlalign.train.sft.objective import Example
from rlalign.train.sft.update import SFTUpdate, batch_indices, batches_per_epoch, build_update

LOGGER = logging.getLogger("rlalign.sft")


def resolve_sft_config(path: "str | None", overrides: list[str]) -> SFTConfig:
    """The command line's config; with ``run.resume=true`` laid over the run directory's saved config.yaml."""
    cfg = load_config(SFTConfig, path, overrides)
    if not cfg.run.resume or not cfg.run.dir:
        return cfg
    saved = read_run_config(Path(cfg.run.dir))
    if saved is None:
        return cfg
    return load_config(SFTConfig, None, None, base=merge(saved, load_raw(path, overrides)))


@dataclasses.dataclass
class SFTData:
    train: list[Example]
    eval: list[Example]
    sha256: dict[str, str]   # data file -> sha256, recorded with every checkpoint


def read_data(cfg: SFTConfig, tokenizer, max_positions: int) -> SFTData:
    d = cfg.data
    limit = min(d.max_length or max_positions, max_positions)
    rows = load_examples(tokenizer, d.path, d, limit)
    files = [d.path] + ([d.eval_path] if d.eval_path else [])
    if d.eval_path:
        train, held = rows, load_examples(tokenizer, d.eval_path, d, limit)
    else:
        if len(rows) < 2 and d.eval_fraction:
            raise SFTDataError(f"{d.path} has {len(rows)} row: too few to hold any out (data.eval_fraction=0 trains "
                               "on it without eval/loss)")
        kept, held_idx = held_out_split(len(rows), d.eval_fraction, cfg.run.seed)
        train, held = [rows[i] for i in kept], [rows[i] for i in held_idx]
    return SFTData(train, held, {f: file_sha256(f) for f in files})


def total_steps(cfg: SFTConfig, rows: int) -> int:
    return cfg.run.steps or cfg.run.epochs * batches_per_epoch(rows, cfg.run.batch_size)


def run_sft(cfg: SFTConfig) -> Path:
    """Run (or resume) the SFT job; returns the run directory."""
    run_dir = Path(cfg.run.dir or f"runs/sft-{time.strftime('%Y%m%d-%H%M%S')}")
    model_dir = resolve_model_dir(cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    data = read_data(cfg, tokenizer, load_model_config(model_dir).max_position_embeddings)
    steps = total_steps(cfg, len(data.train))
    reads = [Path(f) for f in data.sha256] + ([model_dir] if cfg.model.path != "default" else [])
    lock = open_run_dir(run_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite, last_step=steps, reads=reads)
    try:
        model, tokenizer, model_dir = load_policy(cfg.model)
        update = build_update(model, cfg.optim, steps)
        step = state.restore(run_dir, cfg, model, update, data.sha256) if cfg.run.resume else 0
        write_run_config(run_dir, cfg)
        metrics = MetricsWriter(run_dir, resume_after_step=step if cfg.run.resume else None)
        with use_profile(cfg.run.profile):
            _train(cfg, run_dir, model, update, data, metrics, step, steps, model_dir)
        save_model(model, run_dir / "policy", tokenizer_from=model_dir)
    except BaseException:
        lock.abandon()   # a run directory this run made and wrote nothing to is removed again
        raise
    lock.release()
    return run_dir


def _train(cfg, run_dir, model, update, data: SFTData, metrics, step: int, steps: int, model_dir) -> None:
    LOGGER.info(f"rlalign sft: {'resuming at step ' + str(step + 1) if step else 'starting'}; run directory {run_dir}")
    LOGGER.info(f"  model {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters); "
                f"{len(data.train)} train / {len(data.eval)} eval examples; {steps} steps of {cfg.run.batch_size}; "
                f"profile {cfg.run.profile}")
    if step == 0:
        metrics.write({"step": 0, **_evaluate(update, data.eval)})
    started, first = time.perf_counter(), step
    per_epoch = batches_per_epoch(len(data.train), cfg.run.batch_size)
    while step < steps:
        step += 1
        t0 = time.perf_counter()
        batch = [data.train[i] for i in batch_indices(len(data.train), cfg.run.batch_size, step, seed=cfg.run.seed,
                                                      shuffle=cfg.run.shuffle)]
        model.train()
        record = {"step": step, "epoch": (step - 1) // per_epoch + 1, **update.step(batch, step)}
        record["time/train_s"] = time.perf_counter() - t0
        record["tokens_per_s/train"] = sum(len(ex.tokens) for ex in batch) / max(record["time/train_s"], 1e-9)
        last = step == steps
        if step % cfg.run.eval_every == 0 or last:
            record.update(_evaluate(update, data.eval))
        metrics.write(record)
        stop = cfg.run.stop_at_step is not None and step >= cfg.run.stop_at_step and not last
        if step % cfg.run.checkpoint_every == 0 or last or stop:
            state.save(run_dir, cfg, model, update, step, data.sha256)
        if step % cfg.run.log_every == 0 or last:
            eta = (time.perf_counter() - started) / (step - first) * (steps - step)
            LOGGER.info(step_line(record, steps, eta))
        if stop:
            LOGGER.info(f"stopping at step {step}: run.stop_at_step={cfg.run.stop_at_step} reached "
                        "(resume with run.resume=true)")
            break


def _evaluate(update: SFTUpdate, examples: list[Example]) -> dict:
    if not examples:
        return {}
    t0 = time.perf_counter()
    update.model.eval()
    loss = update.eval_loss(examples)
    return {"eval/loss": loss, "time/eval_s": time.perf_counter() - t0}


def step_line(record: dict, steps: int, eta_s: float) -> str:
    parts = [f"step {record['step']}/{steps}", f"epoch {record['epoch']}", f"loss {record['loss/sft']:.4f}"]
    if record.get("eval/loss") is not None:
        parts.append(f"eval {record['eval/loss']:.4f}")
    parts += [f"grad {record['grad_norm']:.3f}", f"lr {record['lr']:.2e}", f"{record['time/train_s']:.2f}s",
              f"{record['tokens_per_s/train']:.0f} tok/s", f"eta {eta_s:.0f}s"]
    return " | ".join(parts)


__all__ = ["run_sft", "resolve_sft_config", "read_data", "total_steps", "step_line"]
