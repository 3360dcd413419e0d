"""Benchmarks run by ``rlalign bench NAME`` (one module each): ``rollout`` -- rollout tokens/s of rlalign's
engine (strict, native) against transformers ``generate``. They sit above the engines they measure."""
