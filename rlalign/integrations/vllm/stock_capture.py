"""Capture the boundaries of stock vLLM's Qwen3 / Qwen2 / Llama (plugin off), for localizing a divergence.

Stock vLLM has no taps, so forward hooks record what its modules expose, under rlalign's names:

    embed (embed_tokens out)   layers.{i}.input_norm (input_layernorm out)
    layers.{i}.q / k / v (the Attention layer's inputs: after qk-norm and rope, as [T, H, D])
    layers.{i}.attn (o_proj in)   layers.{i}.o_proj (o_proj out)
    layers.{i}.residual / post_norm (post_attention_layernorm: fused residual add, then norm)
    layers.{i}.mlp (mlp out)   final_norm (norm out)

Rows are the forward's scheduled tokens; each gets the prefix key of its request's tokens
(read from the model runner's input batch), as rlalign's own paged forwards do, so the rows meet
the trainer's packed rows by content.
"""

from __future__ import annotations

import contextlib

import torch

from rlalign.models.taps import EMBED, FINAL_NORM, layer_tap
from rlalign.parity.capture import RowLayout, capture, prefix_keys


@contextlib.contextmanager
def stock_capture(engine, **kwargs):
    runner = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model = runner.model
    with capture(**kwargs) as cap:
        hooks = _install(cap, runner, model)
        try:
            yield cap
        finally:
            for h in hooks:
                h.remove()


def _install(cap, runner, model) -> list:
    backbone = model.model
    hooks = [model.register_forward_pre_hook(lambda mod, args, kwargs: _begin(cap, runner), with_kwargs=True),
             backbone.embed_tokens.register_forward_hook(_out(cap, EMBED)),
             backbone.norm.register_forward_hook(_out(cap, FINAL_NORM))]
    for i, layer in enumerate(backbone.layers):
        attn = layer.self_attn
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        hooks += [layer.input_layernorm.register_forward_hook(_out(cap, layer_tap(i, "input_norm"))),
                  attn.attn.register_forward_pre_hook(_qkv(cap, i, heads, kv_heads, dim)),
                  attn.o_proj.register_forward_pre_hook(_in(cap, layer_tap(i, "attn"))),
                  attn.o_proj.register_forward_hook(_out(cap, layer_tap(i, "o_proj"))),
                  layer.post_attention_layernorm.register_forward_hook(_post_norm(cap, i)),
                  layer.mlp.register_forward_hook(_out(cap, layer_tap(i, "mlp")))]
    return hooks


def _begin(cap, runner) -> None:
    """Announce the rows of the forward about to run (one per scheduled token, request by request)."""
    from vllm.forward_context import get_forward_context  # lazy: optional, heavy
    meta = get_forward_context().attn_metadata
    if not meta:
        return
    first = next(iter(meta.values()))
    cu = first.query_start_loc.tolist()
    seq_lens = first.seq_lens.tolist()
    batch = runner.input_batch
    layout = RowLayout([], [], [], [], [])
    for i, (start, end) in enumerate(zip(cu[:-1], cu[1:len(seq_lens) + 1])):
        tokens = [int(t) for t in batch.token_ids_cpu[i, :seq_lens[i]]]
        n = end - start
        layout.keys += prefix_keys(tokens)[-n:] if n else []
        layout.labels += [batch.req_ids[i]] * n
        layout.positions += list(range(seq_lens[i] - n, seq_lens[i]))
        layout.tokens += tokens[-n:] if n else []
        layout.last_rows.append(end - 1)
    cap.begin_layout(layout)


def _first(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _out(cap, name: str):
    def hook(mod, args, out):
        cap.record(name, _first(out))
    return hook


def _in(cap, name: str):
    def hook(mod, args):
        cap.record(name, args[0])
    return hook


def _qkv(cap, i: int, heads: int, kv_heads: int, dim: int):
    def hook(mod, args):
        q, k, v = args[:3]
        cap.record(layer_tap(i, "q"), q.reshape(q.shape[0], heads, dim))
        cap.record(layer_tap(i, "k"), k.reshape(k.shape[0], kv_heads, dim))
        cap.record(layer_tap(i, "v"), v.reshape(v.shape[0], kv_heads, dim))
    return hook


def _post_norm(cap, i: int):
    def hook(mod, args, out):
        normed, residual = out
        cap.record(layer_tap(i, "residual"), residual)
        cap.record(layer_tap(i, "post_norm"), normed)
    return hook
