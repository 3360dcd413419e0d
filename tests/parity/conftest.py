import contextlib

import pytest
import torch

from rlalign.models.batch import ForwardBatch
from rlalign.parity.capture import capture, tap


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Thousands of tiny GEMMs: one thread is much faster on a busy 2-core machine (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny random-init checkpoints: {"qwen3": dir, "qwen2": dir, "llama": dir, "qwen3-bf16": dir}."""
    from rlalign.models.testing import make_tiny_checkpoint
    root = tmp_path_factory.mktemp("parity_ckpt")
    out = {f: make_tiny_checkpoint(root / f, family=f, norm_jitter=0.1, num_hidden_layers=3)
           for f in ("qwen3", "qwen2", "llama")}
    out["qwen3-bf16"] = make_tiny_checkpoint(root / "qwen3-bf16", family="qwen3", dtype="bfloat16", norm_jitter=0.1,
                                             num_hidden_layers=3)
    return out


def _hook_taps(model) -> list:
    """Forward hooks tapping what hooks can see of rlalign's decoder (used only while the decoder
    itself has no tap() calls): embed, input_norm, v, attn, o_proj, post_norm, mlp, residual, final_norm."""
    backbone = model.model

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def out_hook(name, fn=first):
        def hook(mod, args, out):
            tap(name, fn(out))
        return hook

    def attn_input(name):
        def hook(mod, args):
            tap(name, args[0])
        return hook

    hooks = [backbone.embed_tokens.register_forward_hook(out_hook("embed")),
             backbone.norm.register_forward_hook(out_hook("final_norm"))]
    for i, layer in enumerate(backbone.layers):
        attn = layer.self_attn
        hooks += [layer.input_layernorm.register_forward_hook(out_hook(f"layers.{i}.input_norm")),
                  attn.v_proj.register_forward_hook(out_hook(f"layers.{i}.v")),
                  attn.o_proj.register_forward_pre_hook(attn_input(f"layers.{i}.attn")),
                  attn.o_proj.register_forward_hook(out_hook(f"layers.{i}.o_proj")),
                  layer.post_attention_layernorm.register_forward_hook(out_hook(f"layers.{i}.post_norm")),
                  layer.mlp.register_forward_hook(out_hook(f"layers.{i}.mlp")),
                  layer.register_forward_hook(out_hook(f"layers.{i}.residual", lambda o: o[0] + o[1]))]
    return hooks


@contextlib.contextmanager
def tapped(model):
    """Make sure rlalign's ``model`` taps its boundaries: a no-op once decoder.py calls tap()."""
    with capture(model=model) as probe, torch.no_grad():
        model.forward_hidden(ForwardBatch.packed([[1, 2, 3]], device=model.device))
    hooks = [] if "layers.0.mlp" in probe.names else _hook_taps(model)
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()
