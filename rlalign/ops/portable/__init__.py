"""The ``portable`` profile's ops: the same bits on the CPU and on a CUDA GPU, by construction.

Every value is computed with operations IEEE 754 rounds correctly and that torch runs one per kernel (no
contraction into FMAs, no reassociation) on both devices: elementwise ``+ - * /`` (a divisor is always a
tensor of ndim >= 1 on the operand's device: CUDA multiplies by a rounded reciprocal for a scalar divisor),
square roots in float64 rounded once to fp32, comparisons, max / argmax, gathers and copies, integer ops. Sums
are balanced pairwise trees of elementwise adds (:func:`rlalign.reductions.tree_sum`), exp / log / sin / cos are
this package's own polynomials (:mod:`.arith`). No GEMM, no library reduction over floats, no vendor math.

Rooms: :mod:`.arith` (the primitives), :mod:`.dense` (linear, rms_norm, rope, silu_mul), :mod:`.attention`
(packed and paged attention), :mod:`.logprob` (LM head, log-prob, entropy), :mod:`.sample` (the sampler),
:mod:`.grad` (the training ops as autograd Functions with a backward in the same arithmetic), :mod:`.registry` (registers them as the ``portable`` backend of :mod:`rlalign.ops._registry`). docs/portable.md.
"""
