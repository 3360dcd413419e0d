"""Input validation shared by the ops: clear errors that name the op and the problem.

The ops use it as one namespace (``from rlalign.ops import _checks as chk``); its rooms:

* :mod:`.arguments` -- dtypes, devices, ranks, layouts, index dtypes (``dtype_ok``, ``ndim``, ...);
* :mod:`.policy` -- where NaN/inf are looked for (``check_policy``: per-op on the CPU, the forward's
  boundary sites on GPUs) and the scope names of per-op messages;
* :mod:`.verdicts` -- the NaN/inf checks and device verdicts (``finite``, ``deferred``), deferred on a GPU
  to the next sync (``flush``, ``requeue``);
* :mod:`.capture` -- CUDA-graph capture state and the static-shape decode form (``capturing_graph``,
  ``static_decode``, ``static_shapes``);
* :mod:`.tensor_cache` -- index validations and derivations done once per forward (``memo``).
"""

from rlalign.contract.errors import ContractError
from rlalign.ops._checks.arguments import STRICT_DTYPES, contiguous, dtype_ok, index_dtype, ndim, same_device
from rlalign.ops._checks.capture import (capture_hint, capturing_graph, decode_step, is_capturing, static_decode,
                                         static_shapes)
from rlalign.ops._checks.policy import (BOUNDARY, BOUNDARY_SITES, CHECKS_ENV, LOCALIZE_HINT, PER_OP, check_policy,
                                        check_scope, use_check_policy)
from rlalign.ops._checks.tensor_cache import TensorCache, memo
from rlalign.ops._checks.verdicts import deferred, finite, finite_verdict, flush, requeue

__all__ = ["ContractError", "TensorCache", "dtype_ok", "same_device", "ndim", "finite", "flush", "requeue", "memo",
           "capturing_graph", "is_capturing", "capture_hint", "contiguous", "index_dtype", "check_policy",
           "use_check_policy", "check_scope", "PER_OP", "BOUNDARY", "BOUNDARY_SITES", "CHECKS_ENV", "decode_step",
           "static_decode", "static_shapes", "deferred", "finite_verdict", "STRICT_DTYPES", "LOCALIZE_HINT"]
