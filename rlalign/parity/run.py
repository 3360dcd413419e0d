"""One parity run: generate with the rollout side, score the same tokens with the training side,
compare every token's logprob bitwise, and (``localize``) find the first op, layer and token that differ.

    result = run_parity(ParityOptions(model="ckpt/", train="transformers"))
    result.ok, result.summary()       # summary(): the ``rlalign parity --json`` object

Localization re-runs both sides under :func:`rlalign.parity.capture.capture`, keeping only rows at
positions before the first mismatching token (bounded memory), and compares every captured
boundary bitwise (:func:`rlalign.parity.compare.compare_captures`, training side = side a).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.parallelize import check_tp
from rlalign.models.checkpoint import load_model
from rlalign.models.tokenizer import load_tokenizer
from rlalign.models.taps import LOGPROB
from rlalign.parity.capture import prefix_keys
from rlalign.parity.compare import CaptureComparison, TokenComparison, TokenMismatch, compare_captures, compare_logprobs
from rlalign.parity.replay import RolloutRecord
from rlalign.parity.sides import ROLLOUT_SIDES, TRAINER_SIDES
from rlalign.parity.tp import tp_parity


class ParityError(RLAlignError):
    """A parity run cannot start (missing model, bad options)."""


@dataclasses.dataclass
class ParityOptions:
    model: str = "default"
    rollout: str = "rlalign"
    train: str = "rlalign"
    prompts: int = 4
    samples: int = 2
    max_new_tokens: int = 16
    profile: str = "strict"
    localize: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    dtype: str | None = None
    device: str = "cpu"
    train_batch: int | None = None       # sequences per training forward (default: all in one)
    record: str | None = None            # write the rollout record here
    replay: str | None = None            # score this recorded rollout instead of generating
    tp: tuple[int, ...] = ()             # also score at these tensor-parallel degrees (rlalign.parity.tp)
    vllm_plugin: bool = True             # --rollout vllm: rlalign's plugin on (strict ops) or off (stock vLLM)


@dataclasses.dataclass
class ParityResult:
    options: ParityOptions
    record: RolloutRecord
    tokens: TokenComparison
    train_weights_hash: str
    localization: CaptureComparison | None = None
    model_dir: str = ""
    tp: dict | None = None               # rlalign.parity.tp.tp_parity's report, with --tp

    @property
    def ok(self) -> bool:
        return self.tokens.ok and (self.tp is None or self.tp["ok"])

    def first_divergence(self) -> dict | None:
        first = self.tokens.first
        if first is None:
            return None
        seq = self.record.sequences[first.sequence]
        out = {"sequence": first.sequence, "prompt_index": seq.prompt_index, "sample": seq.sample,
               "position": first.position, "token": first.token, "rollout_logprob": first.rollout,
               "train_logprob": first.train, "abs_diff": first.abs_diff, "localized": None}
        if self.localization is not None:
            out["localized"] = self._localized()
        return out

    def _localized(self) -> dict:
        loc = self.localization
        if loc.first_divergence is None:
            # every captured boundary agrees: the difference is made after the final norm (LM head / logprob)
            return {"verdict": loc.verdict, "reason": loc.reason,
                    "boundary": LOGPROB if loc.verdict == "identical" else None,
                    "layer": None, "op": LOGPROB if loc.verdict == "identical" else None}
        d = loc.first_divergence
        sequence = _sequence_of_key(self.record, d.key)
        return {"verdict": loc.verdict, "boundary": d.name, "layer": d.layer, "op": d.boundary,
                "sequence": sequence, "position": d.position, "token": d.token, "feature": d.feature,
                "train_value": d.value_a, "rollout_value": d.value_b, "ulp": d.ulp}

    def summary(self) -> dict:
        """The ``--json`` object: ok, tokens_compared, mismatches, max_abs_diff, mean_abs_diff, first_divergence."""
        return {"ok": self.ok, "tokens_compared": self.tokens.tokens_compared, "mismatches": self.tokens.mismatches,
                "max_abs_diff": self.tokens.max_abs_diff, "mean_abs_diff": self.tokens.mean_abs_diff,
                "first_divergence": self.first_divergence(), **({"tp": self.tp["tp"]} if self.tp else {})}

    def details(self) -> dict:
        """Everything a report shows: the summary plus run settings and the localization table."""
        return {**self.summary(),
                "not_comparable": self.tokens.not_comparable or None,
                "model": self.model_dir, "rollout": self.options.rollout, "train": self.options.train,
                "profile": self.options.profile, "prompts": len({s.prompt_index for s in self.record.sequences}),
                "sequences": len(self.record.sequences), "sampling": self.record.sampling,
                "rollout_weights_hash": self.record.weights_hash, "train_weights_hash": self.train_weights_hash,
                "rollout_model": self.record.model, "environment": self.record.environment,
                "localization": self.localization.as_dict() if self.localization else None}


def _sequence_of_key(record: RolloutRecord, key_hex: str | None) -> int | None:
    if not key_hex:
        return None
    key = bytes.fromhex(key_hex)
    for i, seq in enumerate(record.sequences):
        if key in prefix_keys(seq.all_tokens):
            return i
    return None


# ---- the run ---------------------------------------------------------------------------------------------

def resolve_model_dir(model: str) -> Path:
    if model == "default":
        path = Path(__file__).resolve().parents[1] / "assets" / "default_model"
        if not (path / "config.json").is_file():
            raise ParityError(f"the embedded default model is missing ({path}); pass --model DIR")
        return path
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ParityError(f"{model}: not a checkpoint directory (no config.json)")
    return path


def default_prompts(count: int, directory: Path, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of varied lengths: short additions ``"a+b="`` through the checkpoint's
    tokenizer when it has one, else random token ids in [3, vocab)."""
    rng = random.Random(seed)
    tokenizer = _try_tokenizer(directory)
    prompts = []
    for _ in range(count):
        if tokenizer is not None:
            a, b = rng.randint(0, 10 ** rng.randint(1, 6)), rng.randint(0, 10 ** rng.randint(1, 6))
            ids = list(tokenizer.encode(f"{a}+{b}="))
            if ids and all(0 <= t < vocab_size for t in ids):
                prompts.append(ids)
                continue
        prompts.append([rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 24))])
    return prompts


def _try_tokenizer(directory: Path):
    if not (directory / "tokenizer.json").is_file():
        return None
    try:
        return load_tokenizer(directory)
    except Exception:  # noqa: BLE001 -- any unreadable tokenizer: fall back to random prompts
        return None


def _check_options(o: ParityOptions) -> None:
    for flag, name, sides in (("--rollout", o.rollout, ROLLOUT_SIDES), ("--train", o.train, TRAINER_SIDES)):
        if name not in sides:
            raise ParityError(f"{flag} {name!r} is not supported (choose {', '.join(sorted(sides))}; the integrations "
                              "register more sides when rlalign.integrations is imported, as the rlalign CLI does)")
    for name in ("prompts", "samples", "max_new_tokens"):
        if getattr(o, name) < 1:
            raise ParityError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(o, name)}")
    for side in (ROLLOUT_SIDES[o.rollout], TRAINER_SIDES[o.train]):
        if side.check is not None:
            side.check(o)
    if o.profile == "portable" and (o.rollout, o.train) != ("rlalign", "rlalign"):
        raise ParityError("--profile portable runs rlalign's own sides only: use --rollout rlalign --train rlalign")
    if o.tp and (o.train != "rlalign" or o.profile != "strict"):
        raise ParityError("--tp shards rlalign's training side in the strict profile: use --train rlalign --profile strict")


def build_rollout(o: ParityOptions, model, model_dir: Path | None = None):
    """The rollout side named by ``o.rollout`` (a registered :class:`~rlalign.parity.sides.SideBuilder`)."""
    return ROLLOUT_SIDES[o.rollout].build(o, model, model_dir)


def build_trainer(o: ParityOptions, model, model_dir: Path):
    """The training side named by ``o.train``: rlalign's CausalLM, or a registered one (e.g. transformers)."""
    return TRAINER_SIDES[o.train].build(o, model, model_dir)


def run_parity(o: ParityOptions) -> ParityResult:
    _check_options(o)
    model_dir = resolve_model_dir(o.model)
    model, config = load_model(model_dir, dtype=o.dtype, device=o.device)
    if o.tp:
        for degree in o.tp:
            check_tp(config, degree, model)   # fail before generating
    rollout = build_rollout(o, model, model_dir)
    if o.replay:
        record = RolloutRecord.load(o.replay)
        if "portable" in (record.profile, o.profile) and record.profile != o.profile:
            raise ParityError(f"{o.replay} was recorded in the {record.profile} profile: score it with --profile "
                              f"{record.profile} (only portable records compare across devices)")
    else:
        prompts = default_prompts(o.prompts, model_dir, config.vocab_size, o.seed)
        record = rollout.generate(prompts, n=o.samples, max_new_tokens=o.max_new_tokens, temperature=o.temperature,
                                  top_k=o.top_k, top_p=o.top_p, seed=o.seed)
        record.model["path"] = str(model_dir)
    if o.record:
        record.save(o.record)
    trainer = build_trainer(o, model, model_dir)
    result = ParityResult(o, record, compare_tokens(record, trainer), trainer.weights_hash, None, str(model_dir))
    if o.localize and result.tokens.first is not None:
        result.localization = localize(record, rollout, trainer, result.tokens.first)
    if o.tp:
        result.tp = tp_parity(record, str(model_dir), o.dtype, o.device, o.tp)
    return result


def compare_tokens(record: RolloutRecord, trainer) -> TokenComparison:
    """Score ``record`` with ``trainer`` and compare bitwise (not comparable if the weights differ)."""
    train_hash = trainer.weights_hash
    if record.weights_hash and train_hash != record.weights_hash:
        return TokenComparison(0, 0, 0.0, 0.0, [], None,
                               f"different weights: rollout {record.weights_hash[:12]} vs train {train_hash[:12]}")
    train = trainer.score(record)
    seqs = record.sequences
    return compare_logprobs([s.logprobs for s in seqs], train, [s.tokens for s in seqs],
                            [len(s.prompt_tokens) for s in seqs])


def replay(record: RolloutRecord | str, trainer) -> TokenComparison:
    """Score a recorded rollout (or the path of one) with a training side and compare bitwise."""
    if not isinstance(record, RolloutRecord):
        record = RolloutRecord.load(record)
    return compare_tokens(record, trainer)


def regenerate(record: RolloutRecord, rollout) -> RolloutRecord:
    """Run the record's prompts through ``rollout`` again with its sampling settings."""
    prompts: dict[int, list[int]] = {}
    for s in record.sequences:
        prompts.setdefault(s.prompt_index, s.prompt_tokens)
    order = sorted(prompts)
    sp = record.sampling
    redo = rollout.generate([prompts[i] for i in order], n=int(sp.get("n", 1)),
                            max_new_tokens=int(sp.get("max_new_tokens", 16)), temperature=float(sp.get("temperature", 1.0)),
                            top_k=int(sp.get("top_k", 0)), top_p=float(sp.get("top_p", 1.0)), seed=int(sp.get("seed", 0)))
    return redo


def localize(record: RolloutRecord, rollout, trainer, first: TokenMismatch | None = None) -> CaptureComparison:
    """Capture both sides (rows at positions before the first mismatching token, or all rows when
    ``first`` is None) and compare every boundary; the training side is side a."""
    positions = range(0, first.position) if first is not None else None
    with rollout.capture(positions=positions) as rollout_cap:
        redo = regenerate(record, rollout)
    if sorted(s.all_tokens for s in redo.sequences) != sorted(s.all_tokens for s in record.sequences):
        return CaptureComparison("not comparable", "re-running the rollout did not reproduce the recorded tokens",
                                 [], None)
    with trainer.capture(positions=positions) as train_cap, torch.no_grad():
        trainer.score(record)
    return compare_captures(train_cap, rollout_cap, labels=("train", "rollout"))


__all__ = ["ParityOptions", "ParityResult", "ParityError", "run_parity", "compare_tokens", "replay", "localize",
           "regenerate", "default_prompts", "resolve_model_dir", "build_trainer", "build_rollout"]
