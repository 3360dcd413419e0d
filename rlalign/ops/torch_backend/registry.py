"""Registers the torch backend's strict implementations with the dispatcher."""

from rlalign.ops._registry import register
from rlalign.ops.torch_backend import elementwise, linear, norm

register("linear", "torch")(linear.linear)
register("linear_group", "torch")(linear.linear_group)
register("rms_norm", "torch")(norm.rms_norm)
register("rope", "torch")(elementwise.rope)
register("silu_mul", "torch")(elementwise.silu_mul)
register("rope_write_kv", "torch")(elementwise.rope_write_kv)

# attention, logprob, sample and moe register themselves from their modules
from rlalign.ops.torch_backend import attention as _attention  # noqa: E402,F401
from rlalign.ops.torch_backend import logprob as _logprob  # noqa: E402,F401
from rlalign.ops.torch_backend import moe as _moe  # noqa: E402,F401
from rlalign.ops.torch_backend import sample as _sample  # noqa: E402,F401
from rlalign.ops.torch_backend import shard as _shard  # noqa: E402,F401
