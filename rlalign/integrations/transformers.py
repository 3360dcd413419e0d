"""Make a Hugging Face causal LM compute with rlalign ops, so its training forward agrees with the rollout engine.

    from rlalign.integrations.transformers import from_pretrained, patch, token_logprobs

    model = from_pretrained("ckpt/")                  # AutoModelForCausalLM, then patch(model, "strict")
    out = token_logprobs(model, input_ids, attention_mask)   # fp32 [B, S]: log p(input_ids[:, s+1] | <= s)
    loss = -(out.logprobs * advantages * out.mask).sum() / out.mask.sum()
    loss.backward()

Supported: ``Qwen3ForCausalLM``, ``Qwen2ForCausalLM``, ``LlamaForCausalLM`` (dense, full attention,
SiLU MLP, default or llama3 rope) with float32 or bfloat16 parameters; anything else is refused
with :class:`UnsupportedModelError` naming the reason.

What the patch does (per instance; classes and other models are untouched; :func:`unpatch` undoes it):

* the backbone's forward (``model.model``) packs the valid tokens of a padded batch (2-D
  ``attention_mask``, 1 = token) or of a packed batch (``position_ids`` restarting at 0, or
  ``cu_seq_lens_q`` as transformers' flattening collators pass) into one token-major row list,
  exactly the rows of rlalign's packed :class:`~rlalign.models.batch.ForwardBatch`; positions come
  from ``position_ids`` or, without them, count 0, 1, ... over each row's valid tokens (left or
  right padding alike). Outputs are scattered back to [B, S, ...] (padding rows are 0);
* embedding = ``ops.embedding`` (no ``padding_idx`` gradient masking, as in rlalign's model);
  every RMSNorm = ``ops.rms_norm`` (one rounding); every ``nn.Linear`` = ``ops.linear``, with the
  canonical K partition (``k_segments=K_SEGMENTS``) for ``o_proj`` and ``down_proj``;
  MLP = ``down(ops.silu_mul(gate(x), up(x)))``;
* rotary: cos/sin tables from ``ops.rope_inv_freq`` / ``ops.rope_cos_sin`` (float64, stored fp32),
  applied with ``ops.rope`` after the qk-norm (Qwen3);
* attention goes through transformers' ``AttentionInterface`` under the name ``"rlalign"``
  (``ops.attention_varlen`` over the packed rows) and the model's attention implementation is set to it;
* the decoder layers keep transformers' own forward (residual adds are single IEEE adds, as in
  rlalign's fused ``rms_norm(x, residual=r)``), so gradient checkpointing keeps working;
* :func:`token_logprobs` gives per-token logprobs/entropy through ``ops.logprob_entropy`` (fused LM
  head, never materialising [tokens, vocab] logits). ``model(...).logits`` still works (LM head
  through ``ops.linear``, rounded to the parameter dtype) but is not the bitwise path.

The patched forward runs under the patch's profile (``strict`` or ``native``: rlalign's ops with
vendor kernels). Generation with a KV cache is refused: roll out with rlalign's engine.
Taps (:mod:`rlalign.parity.capture`) use the same names as rlalign's model.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch import nn

from rlalign import ops
from rlalign.contract import spec
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import Profile, as_profile, use_profile
from rlalign.models.batch import ForwardBatch
from rlalign.models.checkpoint import load_model_config, resolve_dtype
from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.parity.capture import note_batch, tap

SUPPORTED = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
ATTENTION = "rlalign"
_STATE = "_rlalign_patch"


class UnsupportedModelError(RLAlignError, ValueError):
    """The model cannot be patched (architecture, config feature, dtype or module layout)."""


class UnsupportedInputError(RLAlignError, ValueError):
    """The patched model was called with inputs it cannot compute under the contract."""


@dataclasses.dataclass
class PatchState:
    profile: Profile
    config: ModelConfig
    inv_freq: torch.Tensor            # float64 inverse frequencies (a plain attribute: never cast by .to())
    previous_attention: str | None
    patched: list[nn.Module]          # modules whose instance ``forward`` we set


@dataclasses.dataclass
class TokenLogprobs:
    """fp32 [B, S] tensors aligned with ``input_ids``: ``logprobs[b, s]`` = log p(target of (b, s));
    ``mask[b, s]`` is True where a target exists (a valid token with a next token in its sequence, or
    any valid token when explicit targets were given); elsewhere logprobs/entropy are 0."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    mask: torch.Tensor


# ---- attention through transformers' AttentionInterface -----------------------------------------------

def rlalign_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, Hq, S, D], key/value [B, Hkv, S, D] -> ([B, S, Hq, D], None).

    Packed (B = 1 with ``cu_seq_lens_q``, as the patched model and transformers' flattening collators
    pass): ``ops.attention_varlen`` on the rows as they are. Otherwise the valid tokens are packed from a
    2-D padding mask (or none) and ``position_ids`` (restarting at 0 for packed rows), computed, and
    scattered back (padding rows 0). Causal self-attention only (no KV cache, no dropout).
    """
    if dropout:
        raise UnsupportedInputError("rlalign attention: attention dropout is not supported (set attention_dropout=0)")
    if query.shape[2] != key.shape[2]:
        raise UnsupportedInputError("rlalign attention: keys must be the queries' own tokens (no KV cache); "
                                    f"got {query.shape[2]} queries and {key.shape[2]} keys")
    cu = kwargs.get("cu_seq_lens_q")
    if query.shape[0] == 1 and cu is not None:
        out = ops.attention_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                   cu.to(torch.int32), scale=scaling)
        return out.unsqueeze(0), None
    b, h, s, d = query.shape
    layout = _layout((b, s), query.device, attention_mask=_mask_2d(attention_mask), position_ids=kwargs.get("position_ids"))

    def rows(x):
        return x.transpose(1, 2).reshape(b * s, x.shape[1], d).index_select(0, layout.index)
    out = ops.attention_varlen(rows(query), rows(key), rows(value), layout.batch.cu_seqlens, scale=scaling)
    return layout.unpack(out), None


def _mask_2d(mask):
    if mask is None or mask.dim() == 2:
        return mask
    raise UnsupportedInputError("rlalign attention: needs a 2-D padding mask or none, got a "
                                f"{mask.dim()}-D mask (patch the model with rlalign.integrations.transformers.patch)")


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """Mask function for transformers' mask interface: the 2-D padding mask, or None when there is none."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    return None if bool(mask.all()) else mask


def register_attention() -> None:
    """Register ``"rlalign"`` in transformers' AttentionInterface (and its mask interface); idempotent."""
    from transformers import AttentionInterface  # lazy: heavy
    AttentionInterface.register(ATTENTION, rlalign_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface  # lazy: heavy
        AttentionMaskInterface.register(ATTENTION, _padding_mask)
    except ImportError:  # older transformers without the mask interface
        pass


def _attention_function():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # lazy: heavy
    return ALL_ATTENTION_FUNCTIONS[ATTENTION]


# ---- token layout: padded / packed HF inputs -> rlalign's packed rows -----------------------------------

@dataclasses.dataclass
class _Layout:
    shape: tuple[int, int]          # (B, S)
    index: torch.Tensor             # int64 [T]: flat b * S + s of each packed row (row-major order)
    batch: ForwardBatch             # packed rows: input_ids, positions, cu_seqlens

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, S, ...], zeros at padding (differentiable; an exact copy)."""
        b, s = self.shape
        full = x.new_zeros((b * s,) + tuple(x.shape[1:])).index_copy(0, self.index, x)
        return full.view(b, s, *x.shape[1:])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> [T, ...] (the valid rows in packed order)."""
        b, s = self.shape
        return x.reshape(b * s, *x.shape[2:]).index_select(0, self.index)


def _layout(shape: tuple[int, int], device, *, input_ids=None, attention_mask=None, position_ids=None,
            cu_seq_lens=None) -> _Layout:
    b, s = shape
    if attention_mask is not None:
        if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (b, s):
            raise UnsupportedInputError(f"attention_mask must be a 2-D [batch, seq] = {(b, s)} padding mask "
                                        f"(1 = token, 0 = padding), got shape {tuple(attention_mask.shape)}")
        valid = attention_mask.to(device=device, dtype=torch.bool)
    else:
        valid = torch.ones((b, s), dtype=torch.bool, device=device)
    index = valid.reshape(-1).nonzero().flatten()
    if index.numel() == 0:
        raise UnsupportedInputError("the batch has no tokens (attention_mask is all zero)")
    if cu_seq_lens is not None:
        positions = _positions_from_cu(cu_seq_lens, b, s, bool(valid.all()), device)
    elif position_ids is not None:
        positions = position_ids.to(device).expand(b, s).reshape(-1).index_select(0, index).to(torch.int64)
    else:
        positions = (valid.to(torch.int64).cumsum(1) - 1).reshape(-1).index_select(0, index)
    cu = _sequence_starts(positions, index // s)
    ids = input_ids.reshape(-1).index_select(0, index).to(torch.int64) if input_ids is not None \
        else torch.zeros(index.numel(), dtype=torch.int64, device=device)
    return _Layout((b, s), index, ForwardBatch(ids, positions, cu))


def _positions_from_cu(cu_seq_lens, b, s, no_padding, device) -> torch.Tensor:
    if b != 1 or not no_padding:
        raise UnsupportedInputError("cu_seq_lens_q describes a packed batch: use batch size 1 without padding")
    cu = cu_seq_lens.to(device=device, dtype=torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != s:
        raise UnsupportedInputError(f"cu_seq_lens_q must run from 0 to the {s} tokens, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return torch.arange(s, dtype=torch.int64, device=device) - starts


def _sequence_starts(positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (int32) of packed rows: a sequence starts where the position is 0; every other
    row must continue its row's previous token (position + 1)."""
    starts = positions == 0
    ok = torch.ones_like(starts)
    ok[0] = starts[0]
    if positions.numel() > 1:
        follows = (positions[1:] == positions[:-1] + 1) & (rows[1:] == rows[:-1])
        ok[1:] = starts[1:] | follows
    if not bool(ok.all()):
        t = int((~ok).nonzero()[0])
        raise UnsupportedInputError(
            f"token {t} of the packed batch has position {int(positions[t])} but does not continue a sequence: "
            "positions must count 0, 1, 2, ... within each sequence (every sequence starts at position 0)")
    first = starts.nonzero().flatten()
    total = torch.tensor([positions.numel()], dtype=first.dtype, device=first.device)
    return torch.cat([first, total]).to(torch.int32)


# ---- patched forwards (bound per instance) ----------------------------------------------------------------

def _linear_forward(self, x):
    return ops.linear(x, self.weight, self.bias, k_segments=self._rlalign_k_segments)


def _norm_forward(self, x):
    if self._rlalign_tap_input:  # post-attention norm: its input is the residual stream after the attention add
        tap(self._rlalign_tap_input, x)
    y = ops.rms_norm(x, self.weight, self._rlalign_eps)
    name = self._rlalign_tap
    return tap(name, y) if name else y


def _embedding_forward(self, ids):
    return ops.embedding(ids, self.weight)


def _mlp_forward(self, x):
    return tap(self._rlalign_tap, self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x))))


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *,
                       rlalign_batch: ForwardBatch | None = None, **kwargs):
    """Mirrors rlalign's Attention.forward on packed rows [T, hidden]; returns (out, None) like transformers."""
    if rlalign_batch is None or position_embeddings is None:
        raise UnsupportedInputError("a patched attention module must be called by its patched model")
    i, t = self.layer_idx, hidden_states.shape[0]
    cfg = self._rlalign_config
    q = self.q_proj(hidden_states).view(t, cfg.num_heads, cfg.head_dim)
    k = self.k_proj(hidden_states).view(t, cfg.num_kv_heads, cfg.head_dim)
    v = self.v_proj(hidden_states).view(t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    q, k = ops.rope(q, cos, sin), ops.rope(k, cos, sin)
    tap(f"layers.{i}.q", q)
    tap(f"layers.{i}.k", k)
    tap(f"layers.{i}.v", v)
    cu = rlalign_batch.cu_seqlens
    out, _ = _attention_function()(self, q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                   v.transpose(0, 1).unsqueeze(0), None, scaling=self.scaling, dropout=0.0,
                                   cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    out = tap(f"layers.{i}.attn", out[0].reshape(t, cfg.num_heads * cfg.head_dim))
    return tap(f"layers.{i}.o_proj", self.o_proj(out)), None


def _backbone_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                      inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                      return_dict=None, cache_position=None, cache=None, **kwargs):
    from transformers.modeling_outputs import BaseModelOutputWithPast  # lazy: heavy

    state: PatchState = getattr(self, _STATE)
    if (past_key_values if past_key_values is not None else cache) is not None:
        raise UnsupportedInputError("the rlalign-patched model does not run with a KV cache (generation): roll out "
                                    "with rlalign's RolloutEngine, or call generate(..., use_cache=False)")
    if output_attentions:
        raise UnsupportedInputError("output_attentions is not supported by the rlalign-patched model")
    if (input_ids is None) == (inputs_embeds is None):
        raise UnsupportedInputError("pass exactly one of input_ids and inputs_embeds")
    ref = input_ids if input_ids is not None else inputs_embeds
    layout = _layout(tuple(ref.shape[:2]), ref.device, input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids, cu_seq_lens=kwargs.get("cu_seq_lens_q"))
    embeds = layout.pack(inputs_embeds) if inputs_embeds is not None else None
    with use_profile(state.profile):
        hidden, per_layer = _packed_hidden(self, state, layout.batch, embeds, bool(output_hidden_states))
    return BaseModelOutputWithPast(
        last_hidden_state=layout.unpack(hidden),
        hidden_states=tuple(layout.unpack(h) for h in per_layer) if output_hidden_states else None)


def _packed_hidden(backbone, state: PatchState, batch: ForwardBatch, embeds=None, keep_layers: bool = False):
    """Final-norm hidden rows [T, hidden] of a packed batch (rlalign's forward_hidden, on HF modules)."""
    note_batch(batch)
    h = backbone.embed_tokens(batch.input_ids) if embeds is None else embeds
    tap("embed", h)
    cos, sin = ops.rope_cos_sin(batch.positions, state.inv_freq)
    per_layer = [h] if keep_layers else []
    position_ids = batch.positions.unsqueeze(0)
    for i, layer in enumerate(backbone.layers):
        out = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin),
                    rlalign_batch=batch)
        h = out[0] if isinstance(out, tuple) else out
        if keep_layers:
            per_layer.append(h)
    h = backbone.norm(h)
    if keep_layers:
        per_layer[-1] = h  # transformers' convention: the last entry is after the final norm
    return h, per_layer


# ---- public API --------------------------------------------------------------------------------------------

def patch(model: nn.Module, profile: str | Profile = "strict") -> nn.Module:
    """Make ``model`` (Qwen3/Qwen2/Llama ForCausalLM) compute with rlalign ops under ``profile``; returns it.

    Patching twice only changes the profile. Raises :class:`UnsupportedModelError` for any other
    model, config feature or parameter dtype (strict: float32 / bfloat16).
    """
    profile = as_profile(profile)
    state = getattr(model, _STATE, None)
    if state is not None:
        state.profile = profile
        return model
    config = _check_supported(model, profile)
    register_attention()
    previous = getattr(model.config, "_attn_implementation", None)
    _set_attention(model, ATTENTION)
    state = PatchState(profile, config, ops.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling),
                       previous, [])
    _patch_modules(model, state)
    object.__setattr__(model, _STATE, state)
    object.__setattr__(model.model, _STATE, state)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch` (the modules' class forwards and the previous attention implementation return)."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    for module in state.patched:
        module.__dict__.pop("forward", None)
    if state.previous_attention:
        _set_attention(model, state.previous_attention)
    for obj in (model, model.model):
        obj.__dict__.pop(_STATE, None)
    return model


def is_patched(model: nn.Module) -> bool:
    return getattr(model, _STATE, None) is not None


def from_pretrained(path, *, profile: str | Profile = "strict", dtype: str | torch.dtype | None = None,
                    device: str | torch.device | None = None, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=...)`` then :func:`patch`. ``dtype`` None: the
    checkpoint's ``torch_dtype`` (as rlalign's ``load_model``), so both sides hold the same bits."""
    from transformers import AutoModelForCausalLM  # lazy: heavy

    config = load_model_config(path)
    register_attention()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype or config.dtype),
                                                 attn_implementation=ATTENTION, **kwargs)
    if device is not None:
        model.to(device)
    return patch(model, profile)


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, *, targets: torch.Tensor | None = None,
                   temperature: float = 1.0, with_entropy: bool = False, token_chunk: int | None = None,
                   vocab_chunk: int | None = None, cu_seq_lens_q: torch.Tensor | None = None) -> TokenLogprobs:
    """Per-token logprobs (and entropy) of a patched model, differentiable, without full logits.

    ``logprobs[b, s] = log softmax(h[b, s] @ W_lm.T / temperature)[target]`` computed by
    ``ops.logprob_entropy`` on the packed valid rows (the same rows, bits and gradients as rlalign's
    ``CausalLM.logprobs`` on the packed batch of the same sequences). Default target of (b, s): the
    next token of the same sequence (``input_ids[b, s+1]`` for a padded row); explicit ``targets``
    [B, S] are used as given. Inputs as for the model: padded (2-D ``attention_mask``) or packed
    (``position_ids`` restarting at 0, or ``cu_seq_lens_q``).
    """
    state = _require_patched(model)
    layout = _layout(tuple(input_ids.shape[:2]), input_ids.device, input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids, cu_seq_lens=cu_seq_lens_q)
    batch = layout.batch
    ends = batch.cu_seqlens[1:].long() - 1
    if targets is None:
        rows = torch.cat([batch.input_ids[1:], batch.input_ids.new_zeros(1)]).index_fill(0, ends, 0)
        has_target = torch.ones_like(rows, dtype=torch.bool).index_fill(0, ends, False)
    else:
        rows = layout.pack(targets.to(torch.int64))
        has_target = torch.ones_like(rows, dtype=torch.bool)
    with use_profile(state.profile):
        hidden, _ = _packed_hidden(model.model, state, batch)
        lp, ent = ops.logprob_entropy(hidden, model.lm_head.weight, rows, temperature=temperature,
                                      with_entropy=with_entropy, token_chunk=token_chunk, vocab_chunk=vocab_chunk)
    tap("logprob", lp)
    mask = layout.unpack(has_target)

    def full(x):
        return None if x is None else torch.where(mask, layout.unpack(x), x.new_zeros(()))
    return TokenLogprobs(full(lp), full(ent), mask)


# ---- checks and module patching ------------------------------------------------------------------------

def _require_patched(model) -> PatchState:
    state = getattr(model, _STATE, None)
    if state is None:
        raise UnsupportedModelError("the model is not patched: call rlalign.integrations.transformers.patch(model) "
                                    "or load it with rlalign.integrations.transformers.from_pretrained")
    return state


def _check_supported(model: nn.Module, profile: Profile) -> ModelConfig:
    name = type(model).__name__
    if name not in SUPPORTED:
        hint = " (patch the base model before wrapping it, e.g. with PEFT)" if hasattr(model, "base_model") else ""
        raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name} is not supported; supported: "
                                    f"{', '.join(SUPPORTED)}{hint}")
    try:
        config = ModelConfig.from_hf_dict(model.config.to_dict())
    except ModelConfigError as exc:
        raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name}: {exc}") from None
    if float(getattr(model.config, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name}: attention_dropout="
                                    f"{model.config.attention_dropout} is not supported (set it to 0)")
    _check_modules(model, name, config)
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1 or (profile is Profile.STRICT and not dtypes <= {torch.float32, torch.bfloat16}):
        raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name}: parameters must share one "
                                    f"dtype, float32 or bfloat16 in strict; got {sorted(map(str, dtypes))}")
    return config


def _check_modules(model, name: str, config: ModelConfig) -> None:
    def need(cond: bool, what: str):
        if not cond:
            raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name}: {what}")

    backbone = getattr(model, "model", None)
    need(backbone is not None and hasattr(backbone, "layers") and hasattr(backbone, "embed_tokens")
         and hasattr(backbone, "norm"), "expected model.model with embed_tokens, layers and norm")
    need(isinstance(getattr(model, "lm_head", None), nn.Linear), "expected an nn.Linear lm_head")
    need(len(backbone.layers) == config.num_layers, "the number of layers does not match the config")
    for i, layer in enumerate(backbone.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        need(attn is not None and mlp is not None, f"layer {i} has no self_attn / mlp")
        for owner, proj in ((attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
                            (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")):
            need(type(getattr(owner, proj, None)) is nn.Linear,
                 f"layers.{i}.{proj} is not a plain nn.Linear (quantized or adapter-wrapped layers are not "
                 "supported: merge adapters first, or patch before wrapping)")
        need(attn.o_proj.bias is None and mlp.down_proj.bias is None, f"layer {i}: o_proj/down_proj bias")
        need((attn.q_proj.bias is not None) == config.qkv_bias, f"layer {i}: q/k/v bias does not match the family")
        need(getattr(attn, "sliding_window", None) is None, f"layer {i} uses sliding-window attention")
        need(hasattr(attn, "layer_idx") and attn.layer_idx == i, f"layer {i}: unexpected self_attn.layer_idx")
        if config.qk_norm:
            need(hasattr(attn, "q_norm") and hasattr(attn, "k_norm"), f"layer {i} has no q_norm / k_norm")


def _set_attention(model, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except (AttributeError, ValueError, KeyError):
        model.config._attn_implementation = name
    if getattr(model.config, "_attn_implementation", None) != name:
        model.config._attn_implementation = name


def _bind(module: nn.Module, fn, state: PatchState, **attrs: Any) -> None:
    for key, value in attrs.items():
        object.__setattr__(module, f"_rlalign_{key}", value)
    module.forward = types.MethodType(fn, module)
    state.patched.append(module)


def _norm_eps(norm: nn.Module, default: float) -> float:
    for attr in ("variance_epsilon", "eps"):
        if getattr(norm, attr, None) is not None:
            return float(getattr(norm, attr))
    return default


def _patch_modules(model, state: PatchState) -> None:
    config, backbone = state.config, model.model
    eps = config.rms_norm_eps

    def norm(module, tap_name, tap_input=None):
        _bind(module, _norm_forward, state, eps=_norm_eps(module, eps), tap=tap_name, tap_input=tap_input)

    _bind(backbone.embed_tokens, _embedding_forward, state)
    for i, layer in enumerate(backbone.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _bind(proj, _linear_forward, state, k_segments=None)
        for proj in (attn.o_proj, mlp.down_proj):
            _bind(proj, _linear_forward, state, k_segments=spec.K_SEGMENTS)
        norm(layer.input_layernorm, f"layers.{i}.input_norm")
        norm(layer.post_attention_layernorm, f"layers.{i}.post_norm", f"layers.{i}.residual")
        if config.qk_norm:
            norm(attn.q_norm, None)
            norm(attn.k_norm, None)
        _bind(attn, _attention_forward, state, config=config)
        _bind(mlp, _mlp_forward, state, tap=f"layers.{i}.mlp")
    norm(backbone.norm, "final_norm")
    _bind(model.lm_head, _linear_forward, state, k_segments=None)
    _bind(backbone, _backbone_forward, state)


__all__ = ["patch", "unpatch", "is_patched", "from_pretrained", "token_logprobs", "TokenLogprobs",
           "rlalign_attention", "register_attention", "UnsupportedModelError", "UnsupportedInputError",
           "SUPPORTED", "ATTENTION"]
