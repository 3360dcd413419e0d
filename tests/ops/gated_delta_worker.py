"""Worker of tests/ops/test_gated_delta_interpret.py, run in a subprocess (the interpreter must be switched on, or the
stand-in sm_90 driver installed, before triton is imported).

``--interpret N`` (TRITON_INTERPRET=1, fp32): the Triton backend's gated-delta kernels
(rlalign/ops/triton_backend/gated_delta.py) driven the way the model drives them (rlalign/models/gated_deltanet.py):

* a token's output is bitwise the same whether its sequence runs alone or packed with others (any batch size and
  position), in one call, cut into prefill pieces at any points (each piece from the state the earlier pieces
  closed, its open chunk's earlier rows read back), or decoded one token at a time beside other sequences' rows --
  fixed cases (lengths 1, 63, 64, 130; cuts at and around the chunk boundaries) then N hypothesis-chosen ones;
* the forward agrees with the float64 recurrent rule (one token at a time, transformers'
  ``torch_recurrent_gated_delta_rule`` written out) within 2e-5 x its largest value;
* the backward: the gradients of every input (q, k, v, g, beta and the initial state) against float64 autograd of
  that recurrent rule within 1e-4 x the largest gradient, bitwise the same on a second run.

``--interpret model`` (not run by the CI: ~30 s): the tiny Qwen3-Next models (dense and sparse, fp32) with their rule
routed to these kernels -- packed == random prefill pieces and decode steps through the paged cache, hidden rows bit
for bit; the parameters' gradients twice (bitwise equal) and within 1e-4 of the CPU formula's.

``--sm90 [DK DV ...]``: both kernels compiled for sm_90a at the tiny test shape (and the shapes given, e.g. Qwen3-Next's
128 128); prints ptxas's report per kernel."""

from __future__ import annotations

C = 64
H, DK, DV = 2, 8, 12
FWD_TOL, GRAD_TOL = 2e-5, 1e-4


def sequence(length: int, seed: int):
    """Delta-rule inputs of one sequence, [T, H, ...] fp32: q_hat, k_hat l2-normalised (q_hat also by Dk^-1/2), v,
    g = -softplus-like gates in (-0.6, 0), beta in (0, 1)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, H, DK, generator=gen)
    k = torch.randn(length, H, DK, generator=gen)
    q = q / q.norm(dim=-1, keepdim=True) * DK ** -0.5
    k = k / k.norm(dim=-1, keepdim=True)
    return (q, k, torch.randn(length, H, DV, generator=gen), -0.6 * torch.rand(length, H, generator=gen),
            torch.rand(length, H, generator=gen))


def scan_inputs(seqs, starts, ends):
    """The kernel's [J, B, H, C, ...] inputs and [J, B, C] valid mask for sequence b's absolute positions
    [start_b, end_b): chunks start_b // C .. (end_b - 1) // C, each from its first row (earlier rows of the open
    chunk are read back, as the engine reads them from its pages); zeros past end_b."""
    import torch
    first = [s // C for s in starts]
    jmax = max((e - 1) // C - f + 1 for f, e in zip(first, ends))
    out = []
    for part in range(5):
        tail = tuple(seqs[0][part].shape[2:])
        x = torch.zeros((jmax, len(seqs), C) + tuple(seqs[0][part].shape[1:2]) + tail)
        for b, (seq, f, e) in enumerate(zip(seqs, first, ends)):
            rows = seq[part][f * C:e]
            padded = torch.cat([rows, rows.new_zeros((jmax * C - rows.shape[0],) + tuple(rows.shape[1:]))])
            x[:, b] = padded.view(jmax, C, *rows.shape[1:])
        out.append(x.transpose(2, 3).contiguous())   # [J, B, H, C, ...]
    positions = (torch.tensor(first).view(1, -1, 1) + torch.arange(jmax).view(-1, 1, 1)) * C + torch.arange(C)
    return out, positions < torch.tensor(ends).view(1, -1, 1)


class Scanner:
    """Runs pieces [start, end) of sequences through the forward kernel, keeping each sequence's state after every
    chunk it closed (what the engine's pages keep)."""

    def __init__(self, forward, engine: bool = True):
        self.forward = forward
        self.engine = engine    # the engine's calls also ask for Gamma and U; training's do not
        self.closed = {}    # (sequence id, chunk index) -> state after it

    def run(self, pieces):
        """pieces: [(sequence id, inputs, start, end)] -> per piece the outputs of positions [start, end)
        ([n, H, Dv])."""
        import torch
        seqs = [p[1] for p in pieces]
        starts, ends = [p[2] for p in pieces], [p[3] for p in pieces]
        (q, k, v, g, beta), valid = scan_inputs(seqs, starts, ends)
        state = torch.stack([self.closed[(sid, s // C - 1)] if s >= C else torch.zeros(H, DK, DV)
                             for sid, _, s, _ in pieces])
        out, states, _, _ = self.forward(q, k, v, g, beta, valid, state, store_states=True, store_u=self.engine)
        results = []
        for b, (sid, _, s, e) in enumerate(pieces):
            f = s // C
            for j in range((e - 1) // C - f + 1):
                if bool(valid[j, b, -1]):
                    self.closed[(sid, f + j)] = states[j, b].clone()
            rows = out[:, b].transpose(1, 2).reshape(-1, H, DV)   # [J * C, H, Dv] from position f * C
            results.append(rows[s - f * C:e - f * C])
        return results


def recurrent64(q, k, v, g, beta, state=None):
    """The gated delta rule one token at a time in float64 (transformers' torch_recurrent_gated_delta_rule on
    normalised inputs): S <- exp(g) S; S <- S + k (x) (beta (v - k.S)); o = q.S."""
    import torch
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    s = torch.zeros(H, DK, DV, dtype=torch.float64) if state is None else state.double()
    outs = []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t]).view(H, 1, 1)
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t].unsqueeze(-1)
        s = s + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(outs)


def bits_equal(a, b, what):
    from rlalign.contract.bits import describe_difference, bits_equal as equal
    if not equal(a, b):
        raise AssertionError(f"{what}: {describe_difference(a, b)}")


def check_paths(forward, lengths, cuts, seed, tol: float = FWD_TOL) -> int:
    """Each sequence alone in one call is the reference; all of them packed in one call (in reverse order too); the
    first cut at ``cuts`` into prefill pieces; its tail decoded one token at a time (the last few tokens, crossing
    a chunk boundary where it has one). Returns the number of comparisons."""
    seqs = [sequence(n, seed + i) for i, n in enumerate(lengths)]
    alone = [Scanner(forward, engine=False).run([(0, s, 0, n)])[0] for s, n in zip(seqs, lengths)]
    for i, s in enumerate(seqs):
        ref = recurrent64(*s)
        err = float((alone[i].double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
        if not err <= tol:
            raise AssertionError(f"length {lengths[i]}: {err:.2e} from the float64 recurrent rule")
    packed = Scanner(forward, engine=False).run([(i, s, 0, n) for i, (s, n) in enumerate(zip(seqs, lengths))])
    for i in range(len(seqs)):
        bits_equal(packed[i], alone[i], f"sequence {i} of {lengths}: packed (at {i}) vs alone")
    count = len(seqs)
    n = lengths[0]
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < n)), n]
    scan = Scanner(forward)
    pieces = [scan.run([(0, seqs[0], a, b)])[0] for a, b in zip(bounds, bounds[1:])]
    import torch
    bits_equal(torch.cat(pieces), alone[0], f"length {n} cut at {bounds[1:-1]} vs one call")
    decode_from = max(0, n - 4) if n % C > 3 or n < C else n - (n % C) - 2
    scan = Scanner(forward)
    got = [scan.run([(0, seqs[0], 0, decode_from)])[0]] if decode_from else []
    for p in range(decode_from, n):   # decode steps beside the other sequences' first tokens
        others = [(10 + i, s, 0, min(m, 1 + p % 5)) for i, (s, m) in enumerate(zip(seqs, lengths)) if i]
        got.append(scan.run([(0, seqs[0], p, p + 1), *others])[0])
    bits_equal(torch.cat(got), alone[0], f"length {n}: decode from {decode_from} vs one call")
    return count + 2


def check_gradients(forward, backward, tol: float = GRAD_TOL) -> dict:
    """Two sequences (70 and 23 tokens) packed, a random initial state; the loss sum(out * w)."""
    import torch
    lengths = (70, 23)
    seqs = [sequence(n, 40 + n) for n in lengths]
    (q, k, v, g, beta), valid = scan_inputs(seqs, [0, 0], list(lengths))
    state = torch.randn(2, H, DK, DV, generator=torch.Generator().manual_seed(5)) * 0.3
    out, states, _, _ = forward(q, k, v, g, beta, valid, state, store_states=True, store_u=False)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)) * valid.unsqueeze(2).unsqueeze(-1)
    grads = backward(q, k, v, g, beta, valid, state, states, w, torch.zeros_like(states))
    again = backward(q, k, v, g, beta, valid, state, states, w, torch.zeros_like(states))
    for a, b, name in zip(grads, again, ("q", "k", "v", "g", "beta", "state")):
        bits_equal(a, b, f"d{name}: second backward")
    worst = {}
    for b, n in enumerate(lengths):
        leaves = [x.double().requires_grad_() for x in seqs[b]]
        s0 = state[b].double().requires_grad_()
        ref_out = recurrent64(*leaves, state=s0)
        wb = w[:, b].transpose(1, 2).reshape(-1, H, DV)[:n].double()
        ref = torch.autograd.grad((ref_out * wb).sum(), [*leaves, s0])
        for name, got, r in zip(("q", "k", "v", "g", "beta"), grads[:5], ref[:5]):
            got_b = got[:, b].transpose(1, 2).reshape(-1, *got.shape[2:3], *got.shape[4:])[:n]   # [T, H(, D)]
            err = float((got_b.double() - r).abs().max() / r.abs().max())
            worst[name] = max(worst.get(name, 0.0), err)
        err = float((grads[5][b].double() - ref[5]).abs().max() / ref[5].abs().max())
        worst["state"] = max(worst.get("state", 0.0), err)
    bad = {k: v for k, v in worst.items() if not v <= tol}
    if bad:
        raise AssertionError(f"gradients beyond {tol} of the float64 recurrent rule's: {bad}")
    return worst


def run(examples: int) -> dict:
    from hypothesis import HealthCheck, given, settings, strategies as st
    from rlalign.ops.triton_backend.gated_delta import delta_chunks_backward, delta_chunks_forward
    fixed = [((130, 1), (1, 63, 64, 65, 128)), ((64, 63), (63,)), ((1,), ())]
    count = 0
    for i, (lengths, cuts) in enumerate(fixed):
        count += check_paths(delta_chunks_forward, lengths, cuts, seed=i)
    drawn = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(lengths=st.lists(st.integers(1, 140), min_size=1, max_size=2),
           cuts=st.lists(st.integers(1, 139), max_size=2))
    def hypothesis_case(lengths, cuts):
        drawn.append(check_paths(delta_chunks_forward, lengths, cuts, seed=len(drawn) + 100))

    hypothesis_case()
    return {"comparisons": count + sum(drawn), "hypothesis_cases": len(drawn),
            "gradient_errors": check_gradients(delta_chunks_forward, delta_chunks_backward)}


def route_rule_to_kernels() -> None:
    """Make ``ops.gated_delta.delta_chunks`` take its CUDA branch (the kernels) for CPU tensors in this process."""
    import inspect
    import rlalign.ops.gated_delta as gd
    from rlalign.ops.triton_backend.gated_delta import delta_chunks_backward, delta_chunks_forward
    kernels = {"delta_chunks": delta_chunks_forward, "delta_chunks_backward": delta_chunks_backward}
    gd.strict_impl = lambda op, device, profile=None: kernels[op]
    source = inspect.getsource(gd.delta_chunks)
    assert 'if q.device.type == "cpu":' in source
    exec(compile(source.replace('if q.device.type == "cpu":', "if False:"), gd.__file__, "exec"), gd.__dict__)


def model_paths() -> dict:
    """``--interpret model`` (module docstring)."""
    from tests.cuda.test_cuda_qwen3_next import _model, _packed_grads
    from tests.models.test_qwen3_next import check_random_pieces
    seqs = [list(range(3, 3 + C + 7)), [5, 9, 11]]
    reference = _packed_grads(_model(False, "float32", "cpu"), seqs)     # the CPU formula's
    route_rule_to_kernels()
    check_random_pieces(_model(False, "float32", "cpu"), [C + 3, 5], 1, 16)
    check_random_pieces(_model(True, "float32", "cpu"), [C + 1, 2], 2, 5)
    first, second = (_packed_grads(_model(False, "float32", "cpu"), seqs) for _ in range(2))
    worst = 0.0
    for name, g in first.items():
        bits_equal(second[name], g, f"{name}: second backward")
        worst = max(worst, float((g - reference[name]).abs().max() / reference[name].abs().max().clamp(min=1e-30)))
    if not worst <= GRAD_TOL:
        raise AssertionError(f"model gradients {worst:.2e} from the CPU formula's")
    return {"model_gradient_error": worst}


def sm90() -> dict:
    """Both kernels compiled for sm_90a at Dk x Dv = 8 x 12 (and at each further ``DK DV`` pair on the command line,
    e.g. ``--sm90 128 128``: Qwen3-Next's, minutes of ptxas): name, constexprs, shared memory, ptxas's report."""
    import sys
    import torch
    from tests.sm90 import activate_fake_sm90, compile_only_launches, ptxas_report
    activate_fake_sm90()
    compiled = compile_only_launches()
    from rlalign.ops.triton_backend import gated_delta as G
    extra = [int(a) for a in sys.argv[2:]]
    for dk, dv in ((DK, DV), *zip(extra[::2], extra[1::2])):
        q, v, g = torch.zeros(2, 1, 2, C, dk), torch.zeros(2, 1, 2, C, dv), torch.zeros(2, 1, 2, C)
        valid, s = torch.ones(2, 1, C, dtype=torch.bool), torch.zeros(1, 2, dk, dv)
        states = torch.zeros(2, 1, 2, dk, dv)
        G.delta_chunks_forward(q, q, v, g, g, valid, s, store_states=True, store_u=True)
        G.delta_chunks_backward(q, q, v, g, g, valid, s, states, v, states)
    return {"kernels": [{"kernel": c.name, "args": {k: str(v) for k, v in c.kwargs.items()},
                         "smem": c.kernel.metadata.shared, "ptxas": ptxas_report(c.kernel.asm["ptx"])}
                        for c in compiled]}


if __name__ == "__main__":
    from tests.workers import worker_main
    worker_main(sm90, lambda args: model_paths() if args[0] == "model" else run(int(args[0])))
