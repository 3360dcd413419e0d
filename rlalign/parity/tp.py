"""``rlalign parity --tp 1,2,4``: score a recorded rollout with the training side sharded over
t processes (gloo on CPU, NCCL on GPU: one process per GPU) and compare every token's logprob
bitwise with TP=1 and with the rollout side.

TP=1 is the parallelized model without a process group (run in this process); each degree > 1
spawns t fresh processes that load the checkpoint, shard it with :func:`parallelize`, score the
record (RLAlignTrainer's packed forward) and return rank 0's logprobs. For a mixture-of-experts model each
degree also returns every sparse layer's routing (the experts each token chose), compared with TP=1's.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.distributed.launch import Group, default_backend, spawn
from rlalign.distributed.parallelize import check_tp, parallelize
from rlalign.models.checkpoint import load_model, load_model_config
from rlalign.models.decoder import CausalLM
from rlalign.models.moe import record_routing
from rlalign.parity.compare import compare_logprobs
from rlalign.parity.sides import RLAlignTrainer


def parse_degrees(text: str) -> tuple[int, ...]:
    try:
        degrees = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise RLAlignError(f"--tp {text!r}: expected comma-separated degrees such as 1,2,4") from None
    if not degrees:
        raise RLAlignError("--tp: give at least one degree, e.g. --tp 1,2,4")
    return degrees


def _score(model_dir: str, dtype: str | None, device: str, record, group: Group):
    """(per-sequence completion logprobs, {sparse layer: experts [rows, k] of every scored row, CPU})."""
    model, _ = load_model(Path(model_dir), dtype=dtype, device=device)
    with record_routing() as routing:
        scores = RLAlignTrainer(parallelize(model, group), "strict").score(record)
    return scores, {layer: torch.cat([experts.cpu() for _, experts in entries])
                    for layer, entries in routing.layers.items()}


def _score_worker(world: Group, model_dir: str, dtype: str | None, device: str, record):
    if device.startswith("cuda"):
        device = f"cuda:{world.rank}"
    scores = _score(model_dir, dtype, device, record, world)
    return scores if world.rank == 0 else None


def score_at_degrees(model_dir: str, dtype: str | None, device: str, record, degrees) -> dict[int, tuple]:
    """{degree: (per-sequence completion logprobs, routing)} for every requested degree (and 1, the reference)."""
    config = load_model_config(model_dir)
    shapes = CausalLM(config, device="meta")   # the modules' TP plans, no memory
    for t in degrees:
        check_tp(config, t, shapes)
    out = {1: _score(model_dir, dtype, device, record, Group.single())}
    for t in sorted(set(degrees) - {1}):
        release_cached_memory(device)
        out[t] = spawn(_score_worker, t, model_dir, dtype, device, record, backend=default_backend(device))[0]
    return out


def release_cached_memory(device: str) -> None:
    """Hand this process's cached, unused GPU memory back to the driver before the ranks start: the rank on
    this process's GPU loads a whole checkpoint there, and the rollout engine that generated the record sized
    its KV cache from the free memory (a fraction of the GPU, kept in torch's cache after the engine is gone)."""
    if str(device).startswith("cuda"):
        gc.collect()   # the engine's tensors may sit in reference cycles
        torch.cuda.empty_cache()


def routing_mismatches(reference: dict, other: dict) -> int:
    """Rows (summed over the sparse layers) whose chosen experts differ from ``reference``'s; a layer routed on
    one side only counts all its rows."""
    count = 0
    for layer in set(reference) | set(other):
        a, b = reference.get(layer), other.get(layer)
        if a is None or b is None or a.shape != b.shape:
            count += max(0 if a is None else a.shape[0], 0 if b is None else b.shape[0])
        else:
            count += int((a != b).any(dim=1).sum())
    return count


def tp_parity(record, model_dir: str, dtype: str | None, device: str, degrees) -> dict:
    """{"ok": bool, "tp": {"t": {"tokens_compared", "mismatches" (vs TP=1), "rollout_mismatches",
    "max_abs_diff" (vs TP=1), "routing_mismatches" (rows routed differently from TP=1, MoE models; else None)}}}."""
    seqs = record.sequences
    tokens, prompt_lens = [s.tokens for s in seqs], [len(s.prompt_tokens) for s in seqs]
    results = score_at_degrees(model_dir, dtype, device, record, degrees)
    scores = {t: lp for t, (lp, _) in results.items()}
    moe = bool(results[1][1])
    report = {}
    for t in sorted(set(degrees) | {1}):
        vs_tp1 = compare_logprobs(scores[1], scores[t], tokens, prompt_lens)
        vs_rollout = compare_logprobs([s.logprobs for s in seqs], scores[t], tokens, prompt_lens)
        report[str(t)] = {"tokens_compared": vs_tp1.tokens_compared, "mismatches": vs_tp1.mismatches,
                          "max_abs_diff": vs_tp1.max_abs_diff, "rollout_mismatches": vs_rollout.mismatches,
                          "rollout_max_abs_diff": vs_rollout.max_abs_diff,
                          "routing_mismatches": routing_mismatches(results[1][1], results[t][1]) if moe else None,
                          "not_comparable": vs_tp1.not_comparable or vs_rollout.not_comparable or None}
    ok = all(r["mismatches"] == 0 and r["rollout_mismatches"] == 0 and not r["routing_mismatches"]
             and not r["not_comparable"] for r in report.values())
    return {"ok": ok, "tp": report}


__all__ = ["parse_degrees", "score_at_degrees", "release_cached_memory", "routing_mismatches", "tp_parity"]
