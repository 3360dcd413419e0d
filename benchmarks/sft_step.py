"""One SFT optimizer step on a Qwen3-8B-shaped model: ``rlalign sft``'s step vs transformers' ``Trainer``.

    python benchmarks/sft_step.py --device cuda [--layers 6 --tokens 8192] [--json] [--out FILE]   # the GPU figure
    python benchmarks/sft_step.py --shape tiny --device cpu --iters 1 --warmup 0 --json             # seconds, for CI

The step: forward + backward + optimizer step on the same prompt/response pairs, the loss the mean negative
log-likelihood of the response tokens (prompt tokens unscored), the same weights, for both variants:

    rlalign       exactly what ``rlalign sft`` runs for one step, with the SFT config's defaults
                  (rlalign.train.sft.config.SFTConfig): the policy set up by ``build_update`` (activation
                  checkpointing as ``optim.activation_checkpointing``, default off; fp32 master weights for the bf16
                  weights + torch AdamW over them, ``optim.lr``, ``betas``, ``weight_decay``), then
                  ``SFTUpdate.step`` under ``use_profile(run.profile)`` (strict): the pairs cut into micro-batches
                  of at most ``optim.micro_batch_tokens`` tokens (default 4096; ``--micro-batch-tokens``), each a
                  packed varlen forward (no padding) -> the fused log-prob of the scored rows only (no [T, V]
                  logits) -> backward; gradient-norm clip to ``optim.grad_clip``; the masters' AdamW step; the lr
                  schedule's step. The timed interval is the call to ``SFTUpdate.step`` (it packs the examples
                  into device tensors and reads the loss back, as in a run); not timed: what ``run_sft`` does around
                  a step (metrics line, eval, checkpoints). The model is built in memory with random weights
                  instead of read by ``load_policy`` from a checkpoint.
    transformers  ``Trainer.train()`` for ``warmup + iters`` steps on ``Qwen3ForCausalLM``
                  (attn_implementation="sdpa", the same bf16 weights copied by name), ``TrainingArguments(bf16=True
                  on cuda, per_device_train_batch_size=the number of sequences, gradient_checkpointing=the rlalign
                  default, optim="adamw_torch", learning_rate / adam betas / weight_decay / max_grad_norm equal to
                  rlalign's, report_to=[], save_strategy="no", logging and eval off)``; the sequences right-padded
                  to the longest into one [S, L_max] batch, labels -100 on the prompt and padding tokens (the model's
                  loss: materialised logits, float cross-entropy over the labelled tokens, divided by their count).
                  A callback times each step from ``on_step_begin`` to ``on_step_end`` (device synchronised at both):
                  the Trainer's forward + backward (``training_step``), gradient clip, optimizer and scheduler step
                  and zero_grad -- a user's Trainer step, less the dataloader's fetch and collation of the batch
                  (done before ``on_step_begin``; a few small tensors) and the logging after it (off).

Not the same by construction, and stated so: rlalign trains bf16 weights against fp32 masters with fp32 AdamW
state (16 bytes a parameter with weight and gradient); the Trainer's ``adamw_torch`` steps the bf16 weights with
bf16 state (8 bytes; what a user who loads a bf16 model gets). rlalign computes no padded rows and no logits for
prompt rows; with several micro-batches (8192 tokens > the default 4096) it holds one micro-batch's activations at
a time (``--micro-batch-tokens 8192``: one packed forward, as the Trainer's one padded batch).

The workload: ragged sequences (lengths uniform in [mean/4, 7 mean/4], seeded, the last one the remainder,
``--tokens`` in all; benchmarks/train_step.py's ``sequence_lengths``), random token ids, each split into a prompt
of uniform length in [1, n - 1] and the response (scored, the sequence's last token included). Weights: bf16
(``--dtype``), N(0, 0.02) matrices and norms 1 (train_step's ``_init_weights_``); the shape is
``rlalign.bench.rollout.PRESETS["qwen3-8b"]`` cut to ``--layers`` decoder layers (full 151,936 vocabulary, untied
head), or ``--shape tiny`` (a tiny Qwen3, seconds on a CPU).

Each variant runs in a fresh subprocess on one GPU (the first of ``CUDA_VISIBLE_DEVICES``; a clean peak-memory
reading; an out-of-memory variant is reported as such, the other still runs): ``--warmup`` steps, then
``--iters`` timed steps; ``step_s`` is the median, ``step_s_all`` every timed step.
Peak memory: CUDA ``torch.cuda.max_memory_allocated`` from just after the model is built (weights) through the
last timed step -- weights, gradients, master weights, optimizer state and activations included; CPU the peak
RSS over the same span minus the RSS before the model was built (indicative: allocator caching and thread pools
count). ``tokens_per_s`` counts every real (unpadded) token of the step. ``loss_first``: step 1's loss (before
any update: the two variants agree up to bf16 rounding); ``loss``: the last step's (the optimizers and lr
schedules differ). Ratios: ``time_transformers_over_rlalign`` (> 1: rlalign is faster) and
``memory_rlalign_over_transformers`` (< 1: rlalign needs less).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

VARIANTS = ("rlalign", "transformers")


# ---- workload ------------------------------------------------------------------------------------

def hf_config(args) -> dict:
    """The model's Hugging Face config: the 8B preset (or train_step's tiny shape) with ``args.layers`` layers."""
    from rlalign.bench.rollout import PRESETS
    from train_step import SHAPES
    base = PRESETS["qwen3-8b"] if args.shape == "qwen3-8b" else SHAPES["tiny"]
    return dict(base, num_hidden_layers=args.layers)


def sft_config(args):
    """``rlalign sft``'s config defaults, the micro-batch budget as ``--micro-batch-tokens`` (default: the config's)."""
    from rlalign.train.sft.config import SFTConfig
    cfg = SFTConfig()
    if args.micro_batch_tokens is not None:
        cfg.optim.micro_batch_tokens = args.micro_batch_tokens
    return cfg


def make_examples(args, vocab: int) -> list:
    """The step's prompt/response pairs as ``rlalign.train.sft.objective.Example`` s (see the module doc)."""
    import torch

    from rlalign.train.sft.objective import Example, response_mask
    from train_step import sequence_lengths
    gen = torch.Generator().manual_seed(args.seed + 1)
    out = []
    for i, n in enumerate(sequence_lengths(args.tokens, args.mean_seq, args.seed)):
        tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
        prompt = n if n < 2 else int(torch.randint(1, n, (1,), generator=gen))    # in [1, n - 1]
        out.append(Example(tuple(tokens), response_mask(prompt, n - prompt), f"pair {i}"))
    return out


def _rlalign_model(args):
    import torch

    from rlalign.models.config import ModelConfig
    from rlalign.models.decoder import CausalLM
    from train_step import _init_weights_
    model = CausalLM(ModelConfig.from_hf_dict(hf_config(args)), dtype=getattr(torch, args.dtype), device=args.device)
    _init_weights_(model, args.seed)
    return model.train()


# ---- the two variants (each in its own process) ----------------------------------------------------

def _rlalign_steps(args, examples, meter) -> list[float]:
    """``args.warmup + args.iters`` steps of ``rlalign sft``'s update; -> each step's loss."""
    from rlalign.contract import use_profile
    from rlalign.train.sft.update import build_update
    cfg = sft_config(args)
    model = _rlalign_model(args)
    update = build_update(model, cfg.optim, args.warmup + args.iters)
    meter.built()
    losses = []
    for step in range(1, args.warmup + args.iters + 1):
        meter.begin(step - 1)
        with use_profile(cfg.run.profile):          # as run_sft wraps its training loop
            model.train()
            losses.append(update.step(examples, step)["loss/sft"])
        meter.end(step - 1)
    return losses


def _padded_rows(examples, pad_id: int) -> list[dict]:
    """Each pair right-padded to the longest: input_ids, attention_mask, labels (-100 on prompt and padding)."""
    import torch
    l_max = max(len(ex.tokens) for ex in examples)
    rows = []
    for ex in examples:
        n = len(ex.tokens)
        ids = torch.full((l_max,), pad_id, dtype=torch.long)
        ids[:n] = torch.tensor(ex.tokens)
        mask = torch.zeros(l_max, dtype=torch.long)
        mask[:n] = 1
        labels = torch.full((l_max,), -100, dtype=torch.long)
        scored = torch.tensor(ex.scored, dtype=torch.bool)
        labels[:n][scored] = ids[:n][scored]
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def _transformers_steps(args, examples, meter) -> list[float]:
    """``Trainer.train()`` for ``args.warmup + args.iters`` steps, timed by a callback; -> each step's loss."""
    import torch
    from transformers import (Qwen3Config, Qwen3ForCausalLM, Trainer, TrainerCallback, TrainingArguments,
                              default_data_collator)
    cuda = args.device == "cuda"
    hf = hf_config(args)
    cfg = Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    with torch.device(args.device):      # built in place: no host copy of an 8B-shaped model
        model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=getattr(torch, args.dtype))
    source = _rlalign_model(args)        # the same weights as the rlalign variant (Hugging Face names)
    model.load_state_dict(source.state_dict(), strict=True)
    del source
    model.train()
    optim = sft_config(args).optim
    out_dir = tempfile.mkdtemp(prefix="sft_step_")
    targs = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=len(examples), max_steps=args.warmup + args.iters,
        bf16=cuda, use_cpu=not cuda, gradient_checkpointing=optim.activation_checkpointing, optim="adamw_torch",
        learning_rate=optim.lr, adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], weight_decay=optim.weight_decay,
        max_grad_norm=optim.grad_clip, report_to=[], save_strategy="no", logging_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=args.seed)

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            meter.begin(state.global_step)

        def on_step_end(self, a, state, control, **kw):
            meter.end(state.global_step - 1)

    class LossTrainer(Trainer):
        """Keeps each step's loss tensor (computed and detached by Trainer; read after the run: no extra sync)."""
        losses: list = []

        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            self.losses.append(loss)
            return loss

    trainer = LossTrainer(model=model, args=targs, train_dataset=_padded_rows(examples, cfg.pad_token_id or 0),
                          data_collator=default_data_collator, callbacks=[Timer()])
    meter.built()
    trainer.train()
    return [float(x) for x in trainer.losses]


class Meter:
    """Step times (``begin``/``end`` with the device synchronised) and the peak memory from ``built()`` on."""

    def __init__(self, device: str, warmup: int):
        from logprob_memory import rss_bytes
        self.cuda, self.warmup, self.times, self._t0 = device == "cuda", warmup, [], None
        self.base_rss = rss_bytes()        # before the model is built
        self.peak = 0

    def _sync(self):
        if self.cuda:
            import torch
            torch.cuda.synchronize()

    def built(self):
        from logprob_memory import reset_peak_rss
        self._sync()
        if self.cuda:
            import torch
            torch.cuda.reset_peak_memory_stats()
        reset_peak_rss()                   # the kernel's high-water mark restarts at the current RSS

    def begin(self, index: int):
        self._sync()
        self._t0 = time.perf_counter()

    def end(self, index: int):
        self._sync()
        if index >= self.warmup:
            self.times.append(time.perf_counter() - self._t0)
        self.peak = max(self.peak, self._peak_now())

    def _peak_now(self) -> int:
        if self.cuda:
            import torch
            return torch.cuda.max_memory_allocated()
        from logprob_memory import peak_rss_bytes
        return max(0, peak_rss_bytes() - self.base_rss)


def run_variant(variant: str, args) -> dict:
    """Build the variant, run ``warmup + iters`` steps; -> one result row."""
    import torch
    examples = make_examples(args, hf_config(args)["vocab_size"])
    if variant == "transformers":
        import transformers  # noqa: F401  -- imported before the RSS baseline, as rlalign's modules are
    from rlalign.train.sft import update  # noqa: F401
    meter = Meter(args.device, args.warmup)
    losses = (_transformers_steps if variant == "transformers" else _rlalign_steps)(args, examples, meter)
    if len(meter.times) != args.iters:
        raise RuntimeError(f"{variant}: timed {len(meter.times)} steps, expected {args.iters}")
    return {"variant": variant, "step_s": statistics.median(meter.times), "step_s_all": meter.times,
            "loss_first": losses[0], "loss": losses[-1],
            "peak_gib": meter.peak / 2**30,
            "peak_kind": ("cuda max_memory_allocated (weights, grads, optimizer state, activations)" if meter.cuda else
                          "peak RSS after the model was built minus RSS before it was built"),
            "torch_threads": torch.get_num_threads()}


# ---- driver ----------------------------------------------------------------------------------------

def _run_in_subprocess(variant: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, *_forwarded(args)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.device == "cuda":   # one GPU each: with several visible, the Trainer would wrap the model in DataParallel
        env["CUDA_VISIBLE_DEVICES"] = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = out.stdout.strip().splitlines()
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    if "out of memory" in out.stderr.lower():
        return {"variant": variant, "error": "out of memory"}
    if out.returncode == -9:   # SIGKILL: on a host, what the kernel's OOM killer sends
        return {"variant": variant, "error": "killed (SIGKILL: out of host memory?)"}
    return {"variant": variant, "error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}, no output"])[-1]}


def _forwarded(args) -> list[str]:
    keys = ("shape", "layers", "tokens", "mean_seq", "dtype", "device", "warmup", "iters", "seed")
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys] + \
        ([f"--micro-batch-tokens={args.micro_batch_tokens}"] if args.micro_batch_tokens is not None else [])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["qwen3-8b", "tiny"], default="qwen3-8b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 6; 2 for --shape tiny)")
    p.add_argument("--tokens", type=int, default=None, help="tokens of the step's pairs (default 8192; 256 tiny)")
    p.add_argument("--mean-seq", type=int, default=None, help="mean sequence length (default 1024; 48 tiny)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="rlalign's optim.micro_batch_tokens (default: the SFT config's, 4096)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object instead of a table")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from train_step import fill_shape_defaults
    fill_shape_defaults(args)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}")
    if min(args.layers, args.tokens, args.mean_seq, args.iters) < 1 or args.warmup < 0:
        p.error("--layers, --tokens, --mean-seq and --iters must be >= 1, --warmup >= 0")
    if args.micro_batch_tokens is not None and args.micro_batch_tokens < 1:
        p.error("--micro-batch-tokens must be >= 1")
    return args


def transformers_missing() -> "str | None":
    """Why the transformers variant cannot run here (transformers or accelerate not importable), or None."""
    import importlib.util
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    return f"skipped: {' and '.join(missing)} not installed (pip install transformers accelerate)" if missing else None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_variant(args.worker, args)))
        return 0
    import torch
    examples = make_examples(args, hf_config(args)["vocab_size"])
    rows = []
    for v in args.variants:
        skip = transformers_missing() if v == "transformers" else None
        rows.append({"variant": v, "skipped": skip} if skip else _with_rates(_run_in_subprocess(v, args), examples))
    cfg = sft_config(args)
    from rlalign.train.packing import micro_batches
    lens = [len(ex.tokens) for ex in examples]
    result = {
        "name": "sft_step", "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "transformers": _version("transformers"), "accelerate": _version("accelerate"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or
                                                                              platform.machine()),
        "shape": {"shape": args.shape, "layers": args.layers, "dtype": args.dtype, "sequences": len(lens),
                  "tokens": sum(lens), "scored_tokens": sum(ex.num_scored for ex in examples), "longest": max(lens),
                  "padded_tokens": len(lens) * max(lens)},
        "rlalign_sft": {"profile": cfg.run.profile, "micro_batch_tokens": cfg.optim.micro_batch_tokens,
                        "micro_batches": len(micro_batches(lens, cfg.optim.micro_batch_tokens)),
                        "activation_checkpointing": cfg.optim.activation_checkpointing,
                        "master_weights": cfg.optim.master_weights, "lr": cfg.optim.lr},
        "warmup": args.warmup, "iters": args.iters, "rows": rows, "ratios": _ratios(rows)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else _table(result))
    return 0 if all("step_s" in r or "skipped" in r for r in rows) else 1


def _version(module: str) -> "str | None":
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(module)
    except PackageNotFoundError:
        return None


def _with_rates(row: dict, examples) -> dict:
    if "step_s" in row:
        row["tokens_per_s"] = sum(len(ex.tokens) for ex in examples) / row["step_s"]
    return row


def _ratios(rows) -> dict:
    by = {r["variant"]: r for r in rows if "step_s" in r}
    if not {"rlalign", "transformers"} <= set(by):
        return {}
    t, r = by["transformers"], by["rlalign"]
    return {"time_transformers_over_rlalign": t["step_s"] / r["step_s"],
            "memory_rlalign_over_transformers": r["peak_gib"] / t["peak_gib"] if t["peak_gib"] > 0 else None}


def _table(result) -> str:
    s, c = result["shape"], result["rlalign_sft"]
    lines = [f"SFT step, {s['shape']} x {s['layers']} layers, {s['tokens']} tokens ({s['scored_tokens']} scored) in "
             f"{s['sequences']} pairs (longest {s['longest']}), {s['dtype']}, {result['device']}; rlalign "
             f"{c['profile']}, {c['micro_batches']} micro-batch(es) of <= {c['micro_batch_tokens']} tokens"]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"{r['variant']:>12}: {r['skipped']}")
        elif "step_s" not in r:
            lines.append(f"{r['variant']:>12}: FAILED ({r['error']})")
        else:
            lines.append(f"{r['variant']:>12}: {r['step_s']:8.3f} s  {r['tokens_per_s']:10.0f} tok/s  "
                         f"peak {r['peak_gib']:7.2f} GiB  loss {r['loss_first']:.5f} (step 1) {r['loss']:.5f} (last)")
    lines += [f"{k}: {v:.3f}" for k, v in result["ratios"].items() if v is not None and math.isfinite(v)]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
