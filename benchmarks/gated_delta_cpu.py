"""The strict Gated-DeltaNet rule (rlalign.ops.gated_delta, chunks at absolute positions) against transformers'
pure-torch references on the CPU: its chunked rule (``torch_chunk_gated_delta_rule``: GEMMs and a triangular
solve, chunk 64) and its recurrent rule (``torch_recurrent_gated_delta_rule``: one state update per token).

    python benchmarks/gated_delta_cpu.py                       # defaults: 4 heads, Dk = Dv = 32, T = 512, 1 thread
    python benchmarks/gated_delta_cpu.py --heads 8 --dim 64 --tokens 1024 --threads 2

Measured, each the median of ``--repeats`` runs, fp32, one sequence from a zero state:

* prefill: the whole sequence at once (ours: the packed/prefill path, ``delta_chunks`` over its chunks; the time
  also includes the l2 normalisation of q and k, which both references do inside);
* forward + backward of the prefill (autograd of each formulation; the recurrent reference's backward through
  its T steps);
* decode: the mean cost of one token at positions 0 .. C-1 of a chunk (ours: the intra-chunk part over the open
  chunk's rows up to the token from the state at the chunk's start, solving only the token's own UT row -- the
  earlier rows' come back from the paged stores; the recurrent reference updates the state by one token; the chunked
  reference has no decode path and re-runs the open chunk).

Timings are wall clock on a shared machine: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlalign.contract import spec
from rlalign.ops import gated_delta as gd

C = spec.GDN_CHUNK


def _inputs(t: int, h: int, d: int, grad: bool = False):
    gen = torch.Generator().manual_seed(0)
    xs = (torch.randn(t, h, d, generator=gen), torch.randn(t, h, d, generator=gen), torch.randn(t, h, d, generator=gen),
          -torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen))
    return [x.requires_grad_(grad) for x in xs]


def _chunked(x: torch.Tensor, t: int) -> torch.Tensor:
    j = -(-t // C)
    x = torch.cat([x, x.new_zeros((j * C - t,) + tuple(x.shape[1:]))])
    return x.view(j, C, *x.shape[1:]).unsqueeze(1).transpose(2, 3)


def ours(q, k, v, g, beta, state=None):
    t, h, d = q.shape
    q_hat, k_hat = gd.l2_normalize(q) * d ** -0.5, gd.l2_normalize(k)
    valid = (torch.arange(-(-t // C) * C) < t).view(-1, 1, C)
    state = torch.zeros(1, h, d, v.shape[-1]) if state is None else state
    out, *_ = gd.delta_chunks(*(_chunked(x, t) for x in (q_hat, k_hat, v, g, beta)), valid, state)
    return out.transpose(2, 3).reshape(-1, h, v.shape[-1])[:t]


def reference(name: str):
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    rule = m.torch_chunk_gated_delta_rule if name == "chunked" else m.torch_recurrent_gated_delta_rule

    def run(q, k, v, g, beta):
        return rule(*(x.unsqueeze(0) for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)[0][0]
    return run


def _median_seconds(fn, repeats: int) -> float:
    fn()   # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h, d, t = args.heads, args.dim, args.tokens
    rules = {"rlalign strict (chunks at absolute positions)": ours, "transformers chunked": reference("chunked"),
             "transformers recurrent": reference("recurrent")}
    print(f"Gated-DeltaNet rule, CPU fp32, {h} heads, Dk = Dv = {d}, {t} tokens, {args.threads} thread(s), "
          f"median of {args.repeats}")
    print(f"{'formulation':48s} {'prefill ms':>11s} {'fwd+bwd ms':>11s} {'decode ms/token':>16s}")
    for name, rule in rules.items():
        with torch.no_grad():
            x = _inputs(t, h, d)
            prefill = _median_seconds(lambda: rule(*x), args.repeats)

        def train():
            xg = _inputs(t, h, d, grad=True)
            rule(*xg).sum().backward()
        fwd_bwd = _median_seconds(train, max(1, args.repeats // 2))
        with torch.no_grad():
            decode = _decode_seconds(name, rule, h, d, args.repeats)
        print(f"{name:48s} {prefill * 1e3:11.1f} {fwd_bwd * 1e3:11.1f} {decode * 1e3:16.3f}")


def _decode_seconds(name: str, rule, h: int, d: int, repeats: int) -> float:
    """Mean seconds of one decode token over the positions 0 .. C-1 of a chunk."""
    x = _inputs(C, h, d)
    if name.startswith("transformers recurrent"):
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule as rec
        state = torch.zeros(1, h, d, d)

        def step_all():
            s = state
            for i in range(C):
                _, s = rec(*(t[i:i + 1].unsqueeze(0) for t in x), initial_state=s, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
        return _median_seconds(step_all, repeats) / C
    if name.startswith("transformers chunked"):   # no decode path of its own: the open chunk again per token
        return _median_seconds(lambda: [rule(*(t[:i + 1] for t in x)) for i in range(C)], repeats) / C
    return _median_seconds(lambda: _ours_decode(*x), repeats) / C


def _ours_decode(q, k, v, g, beta):
    """The engine's decode steps over one chunk: token i from the state at the chunk's start, the chunk's rows
    0..i and the Gamma and U of rows < i from the step before (``known``), as the paged stores hand them back."""
    h, d = q.shape[1], q.shape[2]
    q_hat, k_hat = gd.l2_normalize(q) * d ** -0.5, gd.l2_normalize(k)
    inputs = [_chunked(t, C) for t in (q_hat, k_hat, v, g, beta)]
    state, gamma, u = torch.zeros(1, h, d, v.shape[-1]), None, None
    for i in range(C):
        valid = (torch.arange(C) <= i).view(1, 1, C)
        rows = [torch.where(valid.view(1, 1, 1, C, *([1] * (t.dim() - 4))), t, 0.0) for t in inputs]
        _, _, gamma, u = gd.delta_chunks(*rows, valid, state, known=(i, gamma, u) if i else None)


if __name__ == "__main__":
    main()
