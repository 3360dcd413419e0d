"""The strict profile's numerical contract, as data the code uses.

Every constant below is read by the backends (``rlalign.ops``); ``docs/contract.md`` is rendered
from this module (``python -m rlalign.contract.spec > docs/contract.md``) and a test keeps the two
in step. Change a constant here and every engine changes with it; that is the point: the
rollout engine and the trainer can only agree if they read the same numbers.
"""

from __future__ import annotations

import dataclasses

# ---- partitions shared by the backends -------------------------------------------------------
# GEMM row tile: every strict GEMM on the torch backend is issued on row blocks of exactly this
# many rows (zero-padded), so the library never sees a batch-dependent M.
ROW_BLOCK = 64
# Canonical K partition of row-parallel layers (o_proj, down_proj): K is cut into this many equal
# segments (when K allows), each reduced from zero, merged by a fixed balanced binary tree.
K_SEGMENTS = 8
# The same partition for the experts' down_proj of a mixture-of-experts FFN, with 4 segments: expert
# FFNs are narrow (Qwen3-30B-A3B: 768), and 8 segments of 96 columns do not fall on the GEMM's 64-column
# steps -- each would end in a half-masked step (a third of the MMA work wasted) and the GPU kernel could
# not stream its operand by TMA: 3.0 ms vs 1.0 ms unsegmented on the H200 (benchmarks/gpu_moe.py, 2026-12-01).
# 4 segments of 192 are whole steps. Tensor parallelism of the experts therefore goes up to TP=4.
MOE_K_SEGMENTS = 4
# Attention: keys are visited in blocks of this many absolute positions (0, B, 2B, ...);
# queries are processed in tiles of (query, head) rows of exactly ATTN_Q_TILE rows.
ATTN_KV_BLOCK = 64
ATTN_Q_TILE = 16
# Attention on the Triton (CUDA) backend: a row's keys [0, p] are also cut at multiples of this many
# absolute positions ("splits"); each split's online softmax starts from a fresh state and the
# partials merge left to right (s0, s1, s2, ...). The same cut in decode, prefill and training, so a
# decode step can spread one sequence over several programs and keep the prefill's bits. 256: at
# batch 1 with a 4,096 context and 8 kv heads (Qwen3-0.6B/8B) that is 8 x 16 = 128 programs, about the
# H200's 132 SMs; a larger split leaves most SMs idle there (1,024: 32), a smaller one adds merges to
# prefill (one per 4 key blocks at 256) and partials to decode. A row with p < 256 sees one split and
# has the bits of the single online softmax. The CPU (torch) backend does not split (one split).
ATTN_KV_SPLIT = 256
# Fused logprob/entropy: the vocab is reduced in blocks of VOCAB_BLOCK entries (tree sum inside a
# block, then blocks folded left to right). User chunk sizes are rounded to multiples of these.
VOCAB_BLOCK = 1024
TOKEN_BLOCK = ROW_BLOCK
# Default chunk sizes of the fused logprob (multiples of TOKEN_BLOCK / VOCAB_BLOCK: they set memory, not bits).
DEFAULT_TOKEN_CHUNK = 1024
DEFAULT_VOCAB_CHUNK = 8192
# RMSNorm epsilon is the model's; the reduction is a balanced tree over the hidden dim.
# Gated-DeltaNet (Qwen3-Next's linear-attention layers): the recurrence runs in chunks of this many tokens aligned
# to absolute positions 0, C, 2C, ...; its state exists only at these boundaries (training, prefill and decode alike).
GDN_CHUNK = 64

STRICT_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class OpContract:
    op: str
    reduction: str        # what is reduced
    partition: str        # how the reduction domain is cut
    merge: str            # in what order partial results are merged
    accumulate: str       # precision of each stage
    rounding: str         # where results are rounded to the output dtype
    primitives: str       # math primitives used
    invariant_to: str     # what the per-row result does not depend on


CONTRACT: tuple[OpContract, ...] = (
    OpContract(
        "linear", "K (input features) of each output element",
        f"rows issued in blocks of exactly {ROW_BLOCK} (zero padded); K not split; no split-K, no atomics",
        "K order fixed per (K, N): the fixed-shape tile's where it is row invariant on the machine (checked per "
        "shape), else (CPU) one increasing-order fp32 FMA chain per output, compiled; independent of M",
        "inputs upcast to fp32 (bf16 products are exact in fp32); fp32 accumulation",
        "one rounding to the input dtype after bias add (bias added in fp32)",
        "fp32 GEMM on a fixed-shape tile",
        "number of rows, row position, content of other rows",
    ),
    OpContract(
        "linear (canonical K partition)", "K of each output element",
        f"K cut into P={K_SEGMENTS} equal contiguous segments (fewer when K is not divisible: the largest P' <= P dividing K, a power of two)",
        "segment partials (each reduced from zero) merged by a balanced binary tree: ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))",
        "fp32 partials, fp32 tree merge",
        "one rounding after the tree merge (and bias)",
        "fp32 GEMM per segment, fp32 add",
        "everything linear is invariant to, and the tensor-parallel degree (a TP rank owns a subtree)",
    ),
    OpContract(
        "rms_norm", "sum of squares over the hidden dim",
        "whole row", "balanced pairwise tree (halving, odd element carried)",
        "fp32", "one rounding of x * inv_rms * weight to the input dtype; fused residual: (x + residual) rounded to the input dtype first, that sum is returned as the new residual",
        "fp32 mul/add and division (IEEE correctly rounded), the library's sqrt (position invariant; not "
        "necessarily correctly rounded: torch 2.13's CPU sqrt is 1 ulp off for ~16% of fp32 inputs, measured)",
        "number of rows, row position",
    ),
    OpContract(
        "rope", "none (elementwise rotation)", "-", "-",
        "cos/sin tables computed in float64 from positions and inv_freq, stored as fp32; rotation in fp32",
        "one rounding of the rotated value", "fp32 mul/add (rotate-half layout, as in Llama/Qwen)",
        "everything: elementwise, tables indexed by absolute position",
    ),
    OpContract(
        "silu_mul", "none (elementwise)", "-", "-", "fp32: silu(g) = g / (1 + exp(-g)), times up",
        "one rounding", "fp32 exp, add, div, mul", "everything: elementwise",
    ),
    OpContract(
        "embedding", "none (gather)", "-", "-", "-", "none (exact copy)", "index gather", "everything",
    ),
    OpContract(
        "attention", "keys of the query's own sequence (softmax and weighted sum of values)",
        f"keys visited in blocks of {ATTN_KV_BLOCK} aligned to absolute positions 0, {ATTN_KV_BLOCK}, ...; "
        f"queries in tiles of {ATTN_Q_TILE} (query, head) rows; masked keys get score -inf and value 0; "
        f"on the Triton (CUDA) backend the keys are also cut into splits of {ATTN_KV_SPLIT} absolute positions "
        f"(0, {ATTN_KV_SPLIT}, ...), the same in decode, prefill and training (the CPU backend: one split)",
        "online softmax over key blocks in increasing position order, from a fresh state in each split; a block "
        "a query cannot see leaves its state untouched (selected, not multiplied by 1); split partials (m, l, acc) "
        "merged left to right (s0, s1, ...): M' = max(M, m), L' = fma(l, b, L a), ACC' = fma(acc, b, ACC a) with "
        "a = exp2(M - M'), b = exp2(m - M'); a split a query cannot see leaves its total untouched (selected)",
        "scores, running max, running sum and output accumulator in fp32; inside a block: fixed-shape fp32 GEMMs for q.k and p.v, balanced tree for the row sum",
        "one rounding of acc / sum to the input dtype",
        "fp32 GEMM on fixed-shape tiles, exp, max, div",
        "number of sequences, packing vs padding, prefill vs decode, prefill chunking, KV page layout and page size, "
        "how many programs a decode step spreads a sequence's key splits over",
    ),
    OpContract(
        "attention: sliding window and sinks (gpt-oss)", "as attention",
        "as attention: the key blocks stay on the grid of absolute positions; a window of w keys is a mask (a query "
        "at position p sees keys p - w < pos <= p), so its first key may lie anywhere inside a block; the torch "
        "backend's formulation (the compiled CPU kernels implement neither) and the Triton kernels (their "
        "one-program-per-item launch: a tile starts at the first block its first row's window reaches -- the blocks "
        "before it hold no key any of its rows sees -- and the key splits stay where they are, each merged into the "
        "rows that see a key of it); the native profile runs one padded SDPA call with an explicit mask (packed) or "
        "the Triton paged kernel (paged, on CUDA)",
        "as attention, with every block the window leaves without a visible key selected away (a query that saw no "
        "block yet starts from the fresh state at its first visible block); after the last block the head's sink "
        "logit s is folded in as one more step: m' = max(m, s), l' = l exp(m - m') + exp(s - m'), "
        "acc' = acc exp(m - m') (the sink has no value; the Triton kernels fold it after the last split's merge, "
        "base 2, the l' sum one explicit fma); the backward's sink gradient -sum_t exp(s - lse_t) delta_t sums the "
        "tokens by the fixed pairwise tree (both backends)",
        "as attention; the sink logits upcast to fp32",
        "one rounding of acc' / l' to the input dtype",
        "as attention",
        "as attention (window and sinks included): packed == prefill == paged decode",
    ),
    OpContract(
        "logprob / entropy", "vocab (log-sum-exp, expected logit)",
        f"tokens in blocks of {TOKEN_BLOCK}, vocab in blocks of {VOCAB_BLOCK}; chunk sizes are multiples of these and only set memory",
        "per vocab block: max, tree sum of exp(z - max); blocks folded left to right with online rescaling",
        "logits in fp32 (fp32 GEMM), divided by temperature in fp32 (IEEE division by fp32(T), skipped at T = 1: the one temperature rule, rlalign/ops/temperature.py); all statistics fp32",
        "outputs fp32; the [tokens, vocab] logits are never materialised (peak extra O(token_chunk x vocab_chunk))",
        "fp32 GEMM on fixed-shape tiles, exp, log, max",
        "number of tokens, token position, token/vocab chunk sizes",
    ),
    OpContract(
        "sample", "vocab (argmax of perturbed logits)",
        "whole vocab", "argmax; ties broken by the lowest token id",
        "fp32 logits / temperature (the same rule; temperature 0 = greedy, argmax of the raw logits) + Gumbel noise from a counter-based hash RNG keyed by (seed, sequence id, position, token id); a rollout scores the token it samples with logprob / entropy at the sampling temperature (1 when greedy) through one owner, ops.sample_and_score",
        "-", "64-bit integer hash (splitmix64), fp32 log", "batch composition: the token depends on (seed, sequence id, position) and the row's logits only",
    ),
    OpContract(
        "sample: the kept set (top-k, top-p, min-p)", "vocab (which tokens may be drawn)",
        "whole row, in the total order (z desc, token id asc) -- ties, and values equal up to the last bit, broken by "
        "the lower token id",
        "min-p: c = count of fp32 exp(z - max z) >= fp32(min_p), keep the first c of the order (a tighter top-k); "
        "top-k: the first k; top-p: keep a token iff the exact int64 sum of trunc(p * 2**60) over the kept tokens "
        "before it is < top_p * 2**60, p = exp(z - max) / tree_sum over the top-k/min-p set; greedy: the first token",
        "fp32 logits / temperature (the rule above), fp32 exp and probabilities, int64 prefix sums",
        "-", "fp32 exp, IEEE div, balanced tree sum, stable sort, exact integer adds",
        "batch composition, the number of candidates ordered, the backend (the keep mask is this torch formulation "
        "on every device): a row's set depends on its logits' bits and its own settings only",
    ),
    OpContract(
        "sampled_logprob (rollout.logprobs=sampled)", "the kept set K of the row (log-sum-exp over K)",
        "whole row; the kept set recomputed from ops.lm_logits' bits of the row by the sampler's own rule",
        "m = max z (always in K); s = balanced tree sum over the row of exp(z - m) on K, 0 elsewhere; "
        "logprob = z[target] - (m + log s), -inf outside K",
        "fp32 throughout; gradient d/dz = onehot - p_K on K, 0 outside (K held fixed), through / temperature and the "
        "LM head as logprob / entropy's torch backward",
        "outputs fp32; the logits are materialised per token chunk only (peak extra O(token_chunk x vocab))",
        "the strict lm_logits GEMM, fp32 exp, log, max, tree sum",
        "number of tokens, token position, token chunk size: the engine and the trainer get the same bits",
    ),
    OpContract(
        "moe_route (router softmax, top-k, renormalisation)", "experts (softmax denominator; top-k renormaliser)",
        "whole row of E router logits (fp32: the strict linear on fp32 copies of the hidden row and router weight)",
        "softmax: m = max (exact), u = exp(l - m), balanced pairwise tree sum of u in expert-index order, p = u / sum; "
        "top-k by a stable descending sort of p (equal p: the lower expert index first); renormaliser: the k selected "
        "p added left to right in rank order",
        "fp32 throughout", "routing weights stay fp32", "exp, max, IEEE add/div, stable sort",
        "number of tokens, token position, other tokens' routing",
    ),
    OpContract(
        "moe_route_topk_softmax (gpt-oss router)", "the k chosen experts (softmax denominator)",
        "whole row of E router logits (fp32: the strict linear on fp32 copies of the hidden row, router weight and "
        "bias)",
        "top-k by a stable descending sort of the logits (equal logits: the lower expert index first); "
        "m = the first chosen logit (the largest), u = exp(l - m), balanced pairwise tree sum of u in rank order, "
        "w = u / sum",
        "fp32 throughout", "routing weights stay fp32", "exp, IEEE add/div, stable sort",
        "number of tokens, token position, other tokens' routing",
    ),
    OpContract(
        "moe_route_grouped_sigmoid (DeepSeek-V3 router)",
        "each group's two largest; the k chosen scores (renormaliser)",
        "whole row of E router logits (fp32: the strict linear on fp32 copies of the hidden row and router weight), "
        "E / n_group experts per group",
        "score = 1 / (1 + exp(-l)); choice = score + e_score_correction_bias (fp32); group score = its largest "
        "choice + its second largest (stable descending sort); the topk_group groups of a stable descending sort "
        "of the group scores kept (equal: the lower group first), the others' choices set to -inf; top-k by a stable "
        "descending sort of the choices (equal: the lower expert index first); weights = the chosen unbiased scores, "
        "normalised by (their sum left to right in rank order + 1e-20) where norm_topk_prob, times "
        "routed_scaling_factor",
        "fp32 throughout", "routing weights stay fp32", "exp, IEEE add/div/mul, stable sort",
        "number of tokens, token position, other tokens' routing",
    ),
    OpContract(
        "shared_expert_gate (Qwen3-Next's gated shared expert)", "none (elementwise; the gate's logit is the strict "
        "linear of the hidden row with the [1, H] gate weight)", "-", "-",
        "fp32: shared * (1 / (1 + exp(-l))), l the row's gate logit; added to the routed experts' combine in the "
        "model dtype (one rounding of the sum)",
        "one rounding of the product", "fp32 exp, add, div, mul", "everything: elementwise",
    ),
    OpContract(
        "clamped_swiglu (gpt-oss expert activation)", "none (elementwise)", "-", "-",
        "fp32: g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * (g / (1 + exp(-(g * alpha))))",
        "one rounding", "fp32 exp, min, max, add, div, mul", "everything: elementwise",
    ),
    OpContract(
        "moe_experts (expert SwiGLU FFNs)", "H (gate/up) and I (down) of each expert's projections",
        "the (token, slot) rows grouped by expert in stable order (slot order inside a group; integer bookkeeping: "
        "torch.sort on the torch backend, the dispatch kernel on the GPU, rlalign.ops.triton_backend.dispatch, the "
        "same order), each expert's rows through the strict linear per "
        "projection (one grouped GEMM per projection on the GPU, the same per-row arithmetic); down_proj with the "
        "canonical K partition of MOE_K_SEGMENTS = 4 segments",
        "as the strict linear", "as the strict linear and silu_mul", "as the strict linear and silu_mul",
        "strict linear, silu_mul",
        "how many tokens chose the expert (1 or thousands), the order of the tokens, the other experts' loads",
    ),
    OpContract(
        "moe_combine", "a token's k expert outputs",
        "the k (expert output, weight) pairs sorted by expert index",
        "acc = y_0 w_0, then acc = acc + y_j w_j left to right (separate multiply and add, no FMA)",
        "fp32 (expert outputs upcast exactly, fp32 weights)", "one rounding of the sum to the model dtype",
        "fp32 mul, add", "rank order of the experts, everything the experts are invariant to",
    ),
    OpContract(
        "short_conv (Gated-DeltaNet causal conv1d)", "the K taps of a channel (the token and the K-1 before it)",
        "the whole kernel; taps before the sequence's start are zeros (the engine reads the K-1 previous inputs back "
        "from its paged per-token store: exact)",
        "balanced pairwise tree sum of the K products", "fp32", "kept fp32 (SiLU as x / (1 + exp(-x)))",
        "fp32 mul, add, exp, div", "number of tokens, token position, how the sequence was cut",
    ),
    OpContract(
        "delta_chunks (gated delta rule)", "Dk (every dot product) and the rows of a chunk",
        "chunks of GDN_CHUNK = 64 tokens at absolute positions 0, C, 2C, ...; the recurrent state exists only at "
        "chunk boundaries: S_j+1 = exp(G_C-1) S_j + sum_i (k_i exp(G_C-1 - G_i)) (x) v'_i; a token reads the state at "
        "its chunk's start plus the intra-chunk part over the chunk's rows <= itself (forward substitution of the UT "
        "system row by row, rows i > t selected to +0 in each sum over the chunk)",
        "balanced pairwise tree sums (over Dk, over the C rows of the chunk, over j < i in the substitution); the "
        "cumulative gate G_i = G_i-1 + g_i left to right",
        "fp32 throughout (q, k l2-normalised by a tree sum and 1/sqrt; g = -exp(A_log) log(1 + exp(a + dt_bias)); "
        "beta = 1 / (1 + exp(-b)))",
        "the output stays fp32 until the gated RMSNorm rounds once to the model dtype",
        "fp32 mul, add, sub, div, exp, log, sqrt, where",
        "how the sequence was cut: packed training == any chunked prefill == one-token decode; the batch",
    ),
    OpContract(
        "collectives", "ranks", "fixed rank order", "all-reduce as all-gather then the same fixed tree on every rank",
        "fp32", "one rounding after the merge", "fp32 add", "which rank computes; identical on every rank",
    ),
)


def cpu_backend_assumptions() -> tuple[str, ...]:
    """What the torch backend on the CPU relies on; ``rlalign doctor`` checks exactly these."""
    return (
        f"A fp32 GEMM `a @ b.T` of a fixed shape ({ROW_BLOCK} x K) x (K x N) gives each row the same bits "
        "wherever the row sits in the block and whatever the other rows hold -- not for every shape (MKL "
        "breaks it for N = 1 and for narrow N with odd K), so it is checked per (K, N) and thread count at "
        "first use; the shapes that fail run the compiled GEMM kernel for every row instead (row invariant "
        "by construction), or the op raises where the kernels are not built.",
        "The same GEMM gives each column the same bits whatever N is and wherever the column sits "
        "(so vocab chunks and tensor-parallel column shards agree).",
        f"A batched fp32 GEMM of fixed per-item shapes ({ATTN_Q_TILE} x D) x (D x {ATTN_KV_BLOCK}) and "
        f"({ATTN_Q_TILE} x {ATTN_KV_BLOCK}) x ({ATTN_KV_BLOCK} x D) gives each item the same bits whatever the batch count "
        "and the item's index, and each row of an item the same bits wherever it sits in the tile and whatever "
        "the other rows hold (zero padding included) -- not for every D (MKL breaks it for the second shape at "
        "narrow D, e.g. 6 and 10), so it is checked per (shape, thread count) at first use; the shapes that fail "
        "run the compiled GEMM kernel per item instead (row invariant by construction), or the op raises where "
        "the kernels are not built.",
        f"A batched fp32 GEMM (torch.bmm) whose items have the fixed shape ({ROW_BLOCK} x K) x (K x N) gives each "
        "item the same bits as that GEMM issued alone (torch.mm), whatever the batch count, the item's index "
        "and whether the items share one (broadcast) weight matrix: the linear op issues its row blocks "
        "(and K segments) as one batched GEMM -- for the (K, N) whose library tile passes the backend's own "
        "check on the machine (tiles_hold); the others run the compiled row kernel and need nothing of the "
        "library.",
        "Elementwise exp, log and sqrt give the same bits for a value wherever it sits in a tensor "
        "(vectorised body, vector tail, single element); they need not be correctly rounded (torch 2.13's "
        "CPU sqrt is not). sigmoid and rsqrt are NOT used: sigmoid's scalar tail differs from its vector "
        "body on AVX2 (measured), so silu is written as g / (1 + exp(-g)).",
        "Elementwise +, -, *, / are IEEE correctly rounded; max is exact. Sums are never left to a "
        "library reduction: they are written as balanced trees of elementwise adds.",
        "All of the above is deterministic run to run at a fixed thread count.",
        "The compiled CPU kernels (rlalign/ops/torch_backend/csrc: attention, RMSNorm, RoPE, the SwiGLU "
        "product, the K-partition merge) give the torch formulation's bits: they perform its operations in "
        "its order (q.k and p.v as increasing-order FMA chains from 0, which is what 3. computes here), call "
        "torch for exp and sqrt, and are used for a head_dim only after reproducing the formulation on it. "
        "The GEMM kernel stands in for the linear's tiles where they reproduce it (checked per shape), and is "
        "the linear's definition for the shapes where 1. fails.",
    )


def render_markdown() -> str:
    lines = [
        "# The numerical contract (strict profile)",
        "",
        "Rendered from `rlalign/contract/spec.py` by `python -m rlalign.contract.spec`; do not edit by hand.",
        "",
        "For every op the strict profile fixes the reduction domain, its partition, the merge order, the",
        "precision of each stage, where rounding happens and which primitives are used. A row's (token's)",
        "result then depends only on that row's inputs (and, for attention, on its own sequence's keys",
        "and values).",
        "",
        "## Constants",
        "",
        "| name | value |",
        "|---|---|",
    ]
    for name in ("ROW_BLOCK", "K_SEGMENTS", "MOE_K_SEGMENTS", "ATTN_KV_BLOCK", "ATTN_Q_TILE", "ATTN_KV_SPLIT",
                 "VOCAB_BLOCK", "TOKEN_BLOCK"):
        lines.append(f"| `{name}` | {globals()[name]} |")
    lines.append(f"| strict dtypes | {', '.join(STRICT_DTYPES)} |")
    lines += ["", "## Per op", ""]
    for c in CONTRACT:
        lines += [f"### {c.op}", ""]
        for field in dataclasses.fields(OpContract):
            if field.name == "op":
                continue
            lines.append(f"- **{field.name.replace('_', ' ')}**: {getattr(c, field.name)}")
        lines.append("")
    lines += [
        "## What the CPU (torch) backend relies on",
        "",
        "Strict on the CPU is invariant by construction given these properties of the machine's",
        "libraries; `rlalign doctor --device cpu` checks each of them with fresh random inputs on the",
        "shapes the backend issues, and strict relies on it being green:",
        "",
    ]
    lines += [f"{i}. {a}" for i, a in enumerate(cpu_backend_assumptions(), 1)]
    lines += [
        "",
        "CPU and GPU need not agree bit for bit; each device agrees with itself across engines.",
        "The triton backend (CUDA) fixes the same kinds of choices with its own constants (BLOCK_K=64 for",
        "every GEMM, 256-column vocab tiles, base-2 exponent, bf16x3 for fp32 inputs); they are listed in",
        "[docs/gpu.md](gpu.md). On CUDA the library checks above are not run: strict does not rely on",
        "cuBLAS, which is neither row- nor batch-count-invariant there (measured).",
        "",
        "## What the native profile promises",
        "",
        "Nothing beyond the accuracy tolerances: vendor kernels (MKL/oneDNN, cuBLAS, SDPA), whatever",
        "reduction order they pick for the shape at hand. It is built to be the fair fast baseline a",
        "non-deterministic trainer would run, so strict/native measures the contract's cost: linears are",
        "`F.linear` (cuBLAS); packed training attention is the flash varlen kernel on CUDA (no padding;",
        "`aten._flash_attention_forward`/`_backward` with cu_seqlens), falling back to one padded SDPA call",
        "with a log line naming why (CPU, fp32, an unsupported head_dim); the log-prob loss is fused like",
        "strict's (token chunks of `token_chunk`, fp32 logits from a bf16 GEMM on CUDA, a recomputing",
        "backward, no [T, V] logits kept). In the rollout engine it is the fast non-deterministic engine",
        "on the same machinery (decode graphs that sample, overlapped steps): paged attention on CUDA is",
        "the Triton paged kernel reading K/V through the page table, launched by the batch's shape and the",
        "SM count, without the contract's checks (elsewhere K/V are gathered for one SDPA call); the",
        "sampler is an exponential race over the tempered, top-k/top-p-filtered logits whose noise comes",
        "from the device's default generator inside decode graphs. Its bits may depend on the batch.",
        "",
        "## What the portable profile promises",
        "",
        "Strict's promises, and the same bits on the CPU and on a CUDA GPU: every op is built only from",
        "operations IEEE 754 rounds correctly, one per torch kernel (elementwise `+ - * /`, comparisons,",
        "max, integer ops, copies), with fixed pairwise trees for every sum and its own exp / log / sqrt /",
        "sin / cos. Rollout, scoring and training (its own backward, a fixed-order gradient norm and",
        "AdamW) of dense decoders; anything else raises. An audit mode, tens of times slower than strict:",
        "[docs/portable.md](portable.md).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
