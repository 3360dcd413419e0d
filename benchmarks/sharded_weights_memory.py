"""Benchmark: memory per data-parallel rank of one training step with ``parallel.shard`` none / grads / params (CPU,
gloo processes).

Each of ``--dp`` spawned processes builds the same randomly initialised bf16 decoder of a Qwen3 shape (``--layers``,
``--hidden``, ``--vocab``; the intermediate size 3 x hidden), trained as rlalign's trainer does (fp32 masters,
``torch.optim.AdamW(foreach=False)``; the unsharded step: ``all_reduce_gradients_``, ``clip_grad_norm_``,
``MasterWeights.step``; sharded: ``ShardedMaster``'s reduce-scatter, clip and step), ``--micro`` micro-batches of
``--tokens`` tokens per rank and step. Step 1 allocates the AdamW state; step 2 is measured:

- ``weights_between_steps``: bytes of weights the rank holds after the step (tensors' bytes; with ``params`` its
  range, else every parameter);
- ``weights_peak``: with ``params``, the most held after any gather during step 2 (ranges + gathered units);
- ``state_bytes``: masters + AdamW moments the rank holds;
- ``rss_before`` / ``rss_peak``: the process's resident set before step 2 and its high-water mark during it
  (``/proc/self/status`` VmRSS / VmHWM, the mark reset through ``/proc/self/clear_refs`` after step 1; Linux; the
  ranks run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set).

No rollout engine or reference model is built (a trainer with ``parallel.shard=params`` adds the engine's whole copy).

    python benchmarks/sharded_weights_memory.py [--dp 2] [--layers 16] [--hidden 512] [--vocab 4096]
                                                [--modes none,grads,params] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch

from rlalign.distributed import spawn
from rlalign.distributed.data_parallel import all_reduce_gradients_
from rlalign.distributed.launch import Group
from rlalign.models.batch import ForwardBatch
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.train import parallel as par
from rlalign.train.master import MasterWeights
from rlalign.train.sharding import ShardedMaster

MODES = ("none", "grads", "params")


def _model(layers: int, hidden: int, vocab: int) -> CausalLM:
    config = ModelConfig.from_hf_dict(dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=3 * hidden, num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=True,
        hidden_act="silu", torch_dtype="bfloat16", num_hidden_layers=layers))
    return CausalLM(config, dtype=torch.bfloat16).init_random_(seed=0).train()


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rank(world: Group, mode: str, layers: int, hidden: int, vocab: int, tokens: int, micro: int) -> dict:
    torch.set_num_threads(1)
    model = _model(layers, hidden, vocab)
    sharded = mode != "none"
    master = ShardedMaster(model, world, shard_params=mode == "params") if sharded else MasterWeights(model)
    optimizer = torch.optim.AdamW(master.optim_params(), lr=1e-5, foreach=False)
    weights, peak = getattr(master, "weights", None), [0]
    if weights is not None:
        gather = weights.gather

        def measured(runs):
            gather(runs)
            peak[0] = max(peak[0], weights.held_bytes())

        weights.gather = measured
    gen = torch.Generator().manual_seed(world.rank)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for _ in range(micro):
            ids = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
            lp, _ = model.logprobs(ForwardBatch.packed([ids], "cpu"), torch.tensor(ids[1:] + [0]))
            (-lp.sum() / 1000.0).backward()
        if sharded:
            master.reduce_gradients()
            master.clip(1.0)
            master.step(optimizer)
        else:
            all_reduce_gradients_(model.parameters(), world)
            par.clip_grad_norm_(model, 1.0)
            master.step(optimizer)

    step()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # resets VmHWM to the current resident set
    rss_before, peak[0] = _status("VmRSS"), 0
    step()
    rss_peak = _status("VmHWM")
    held = weights.held_bytes() if weights is not None else sum(p.numel() * p.element_size() for p in model.parameters())
    state = (master.state_bytes(optimizer) if sharded else
             sum(t.numel() * t.element_size() for t in master.optim_params() if t.dtype == torch.float32)
             + sum(v.numel() * v.element_size() for s in optimizer.state.values() for k, v in s.items() if k != "step"))
    return {"weights_between_steps": held, "weights_peak": peak[0] or held, "state_bytes": state,
            "rss_before": rss_before, "rss_peak": rss_peak}


def measure(dp: int, layers: int, hidden: int, vocab: int, tokens: int, micro: int, modes=MODES) -> dict:
    out = {}
    for mode in modes:
        ranks = spawn(_rank, dp, mode, layers, hidden, vocab, tokens, micro)
        out[mode] = {key: max(r[key] for r in ranks) for key in ranks[0]}
    params = sum(p.numel() for p in _model(layers, hidden, vocab).parameters())
    return {"dp": dp, "layers": layers, "hidden": hidden, "vocab": vocab, "parameters": params,
            "tokens": tokens, "micro_batches": micro, "per_rank_max": out}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES), help="parallel.shard values to run (comma-separated)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    # every allocation above 64 KiB mapped on its own and unmapped when freed: glibc's adaptive threshold would
    # otherwise keep freed weights and gradients in the heap, and the resident set would not show what was released
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    modes = tuple(args.modes.split(","))
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: a comma-separated subset of {', '.join(MODES)}")
    result = measure(args.dp, args.layers, args.hidden, args.vocab, args.tokens, args.micro, modes)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    mib = 2 ** 20
    print(f"dp={result['dp']}, {result['parameters'] / 1e6:.1f}M parameters (bf16), {args.micro} x {args.tokens} "
          "tokens per rank; MiB, the largest rank's")
    print(f"{'shard':8} {'weights held':>13} {'weights peak':>13} {'masters+AdamW':>14} {'RSS before':>11} "
          f"{'RSS peak':>9}")
    for mode, r in result["per_rank_max"].items():
        print(f"{mode:8} {r['weights_between_steps'] / mib:13.1f} {r['weights_peak'] / mib:13.1f} "
              f"{r['state_bytes'] / mib:14.1f} {r['rss_before'] / mib:11.1f} {r['rss_peak'] / mib:9.1f}")


if __name__ == "__main__":
    main()
