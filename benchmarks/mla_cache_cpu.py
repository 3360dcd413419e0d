"""DeepSeek-V3's KV cache, the compressed latent (the default) against the expanded per-head K/V: bytes per token and
layer, and the decode step time of a small CPU model (the latent form re-expands the earlier context's keys and values
through kv_b_proj at every call; the expanded form reads them back).

    python benchmarks/mla_cache_cpu.py                               # defaults below, 1 thread
    python benchmarks/mla_cache_cpu.py --contexts 64 512 2048 --batch 4 --threads 2 --dtype bfloat16

Measured, per context length L: ``--batch`` sequences are prefilled to L - 1 tokens in each form, then one decode step
(one token per sequence at position L - 1) is timed (this process's CPU time; ``--wall``: the wall clock), the median
of ``--repeats`` runs of the model's forward
(``CausalLM.forward_hidden`` on a paged ``ForwardBatch``, strict profile; the same cache pages each run: the step
rewrites the same slots; the two forms' runs interleaved). The two forms' hidden rows are checked equal bit for bit
before timing. The model: the tiny DeepSeek-V3 of rlalign.models.testing scaled by the options (every layer dense
unless ``--moe``). On a shared machine read the timings as ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from rlalign.contract import bits, use_profile
from rlalign.models import ForwardBatch, KVCache
from rlalign.models.batch import pages_needed
from rlalign.models.config import ModelConfig
from rlalign.models.latent_cache import EXPANDED, LATENT
from rlalign.models.sizes import kv_bytes_per_token
from rlalign.models.testing import tiny_hf_config, tiny_model

# DeepSeek-V3's published attention shape (config.json of deepseek-ai/DeepSeek-V3), for the computed sizes
DEEPSEEK_V3 = dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=2048,
                   intermediate_size=18432, first_k_dense_replace=3, head_dim=64, vocab_size=129280)


def bytes_per_token_layer(config: ModelConfig, element_size: int) -> dict[str, int]:
    """{form: cache bytes one token takes in one layer}."""
    return {form: kv_bytes_per_token(config, element_size, form) // config.num_layers for form in (LATENT, EXPANDED)}


def build_model(args) -> torch.nn.Module:
    return tiny_model("deepseek_v3", seed=0, init_std=0.1, dtype=args.dtype, hidden_size=args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      kv_lora_rank=args.latent, q_lora_rank=args.latent * 2, qk_nope_head_dim=args.nope,
                      qk_rope_head_dim=args.rope, head_dim=args.rope, v_head_dim=args.nope,
                      first_k_dense_replace=0 if args.moe else args.layers)


def prefilled(model, form: str, batch: int, context: int, page_size: int):
    """(cache, block tables, the decode step's ForwardBatch) with ``batch`` sequences of context - 1 tokens cached."""
    per_seq = pages_needed(context, page_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    cache = KVCache.for_model(model.config, batch * per_seq, page_size, model.dtype, mla_cache=form)
    gen = torch.Generator().manual_seed(context)
    prompts = [torch.randint(3, model.config.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    if context > 1:
        model.forward_hidden(ForwardBatch.prefill([p[:-1] for p in prompts], cache, tables))
    step = ForwardBatch.decode([p[-1] for p in prompts], [context - 1] * batch, cache, tables)
    return step


def fresh(batch: ForwardBatch) -> ForwardBatch:
    """A new batch of copied index tensors, as the engine builds one per step: the ops' per-tensor argument checks
    (remembered by tensor) and the latent cache's per-forward plan run again, as they do in a real decode step."""
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).clone()
                                         for f in dataclasses.fields(batch) if f.name != "kv_cache"})


def median_ms(runs: dict, repeats: int, clock=time.process_time) -> dict[str, float]:
    """{name: median milliseconds of runs[name]()} by ``clock`` (default: this process's CPU time, which other
    processes' load on a shared machine disturbs less than the wall clock), the runs interleaved (A, B, A, B, ...)
    so that what load remains drifts over both alike; one warm-up each."""
    times = {name: [] for name in runs}
    for r in range(repeats + 1):
        for name, fn in runs.items():
            t0 = clock()
            fn()
            if r:
                times[name].append(1e3 * (clock() - t0))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--latent", type=int, default=64, help="kv_lora_rank")
    ap.add_argument("--nope", type=int, default=32, help="qk_nope_head_dim (and v_head_dim)")
    ap.add_argument("--rope", type=int, default=16, help="qk_rope_head_dim")
    ap.add_argument("--moe", action="store_true", help="routed + shared experts on every layer (default: dense)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--wall", action="store_true", help="time by the wall clock (default: the process's CPU time)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time
    model = build_model(args)
    elem = torch.empty((), dtype=model.dtype).element_size()
    real = ModelConfig.from_hf_dict(tiny_hf_config("deepseek_v3", **DEEPSEEK_V3))
    for name, cfg, size in (("this model", model.config, elem), ("DeepSeek-V3 (computed, bf16)", real, 2)):
        b = bytes_per_token_layer(cfg, size)
        print(f"{name}: cache bytes per token per layer: latent {b[LATENT]:,}, expanded {b[EXPANDED]:,} "
              f"({b[EXPANDED] / b[LATENT]:.1f}x)")
    a = model.config.attention_options
    print(f"decode step, CPU {args.dtype}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, latent "
          f"{a['kv_lora_rank']}, K head {a['qk_nope_head_dim']} + {a['qk_rope_head_dim']}, batch {args.batch}, "
          f"page size {args.page_size}, {args.threads} thread(s), median of {args.repeats} "
          f"({'wall clock' if args.wall else 'process CPU time'})")
    print(f"{'context':>8s} {'expanded ms':>12s} {'latent ms':>10s} {'latent/expanded':>16s}")
    with use_profile("strict"), torch.no_grad():
        for context in args.contexts:
            steps = {form: prefilled(model, form, args.batch, context, args.page_size) for form in (LATENT, EXPANDED)}
            hidden = {form: model.forward_hidden(step) for form, step in steps.items()}
            if not bits.bits_equal(hidden[LATENT], hidden[EXPANDED]):
                raise SystemExit(f"context {context}: the two cache forms gave different bits")
            ms = median_ms({form: (lambda s=step: model.forward_hidden(fresh(s))) for form, step in steps.items()},
                           args.repeats, time.perf_counter if args.wall else clock)
            print(f"{context:8d} {ms[EXPANDED]:12.2f} {ms[LATENT]:10.2f} {ms[LATENT] / ms[EXPANDED]:16.2f}")


if __name__ == "__main__":
    main()
