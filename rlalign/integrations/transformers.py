"""Make a Hugging Face causal LM compute with rlalign ops, so its training forward agrees with the rollout engine.

    from rlalign.integrations.transformers import from_pretrained, patch, token_logprobs

    model = from_pretrained("ckpt/")                  # AutoModelForCausalLM, then patch(model, "strict")
    out = token_logprobs(model, input_ids, attention_mask)   # fp32 [B, S]: log p(input_ids[:, s+1] | <= s)
    loss = -(out.logprobs * advantages * out.mask).sum() / out.mask.sum()
    loss.backward()

Supported: the ``*ForCausalLM`` class of every family in rlalign's architecture registry
(:mod:`rlalign.models.architectures`: ``Qwen3ForCausalLM``, ``Qwen2ForCausalLM``, ``LlamaForCausalLM``,
``Qwen3MoeForCausalLM``; full attention, SiLU MLP, default or llama3 rope) with float32 or bfloat16
parameters. The module's class decides the family (``config.architectures`` may name e.g. the headless
``Qwen3Model``); anything else is refused with :class:`UnsupportedModelError` naming the reason.

What the patch does (per instance; classes and other models are untouched; :func:`unpatch` undoes it):

* the backbone's forward (``model.model``) packs the valid tokens of a padded batch (2-D
  ``attention_mask``, 1 = token) or of a packed batch (``position_ids`` restarting at 0, or
  ``cu_seq_lens_q`` as transformers' flattening collators pass) into one token-major row list,
  exactly the rows of rlalign's packed :class:`~rlalign.models.batch.ForwardBatch`; positions count
  0, 1, ... over each sequence's valid tokens (left or right padding alike): ``position_ids`` mark
  where sequences start (0) and must continue by 1 except right after padding, which never counts
  (transformers' generate() on right-padded prompts). Outputs are scattered back to [B, S, ...]
  (padding rows are 0);
* the math is rlalign's own: the patch adapts the Hugging Face modules (same parameter names) so
  that the functional block cores of :mod:`rlalign.models.blocks` -- the ones ``CausalLM`` runs --
  can call them: embedding = ``ops.embedding`` (no ``padding_idx`` gradient masking); every RMSNorm
  = ``ops.rms_norm`` (``norm(x, residual)`` fuses the residual add, one rounding); every
  ``nn.Linear`` = ``ops.linear``, with the canonical K partition (``k_segments=K_SEGMENTS``) for
  ``o_proj`` and ``down_proj``; attention, FFN and decoder-layer forwards = the block cores;
* rotary: cos/sin tables from ``ops.rope_inv_freq`` (computed on the CPU, so a model built under a
  meta-device context works after ``to_empty``) / ``ops.rope_cos_sin`` (float64, stored fp32);
* attention goes through transformers' ``AttentionInterface`` under the name ``"rlalign"``
  (``ops.attention_varlen`` over the packed rows) and the model's attention implementation is set to it;
* decoder layers are still called through their class's ``__call__``, so gradient checkpointing
  keeps working;
* :func:`token_logprobs` gives per-token logprobs/entropy through ``ops.logprob_entropy`` (fused LM
  head, never materialising [tokens, vocab] logits). ``model(...).logits`` still works (LM head
  through ``ops.linear``, rounded to the parameter dtype) but is not the bitwise path.

The patched forward runs under the patch's profile (``strict`` or ``native``: rlalign's ops with
vendor kernels). The patched backbone returns what the module's own forward returns: its annotated output
class (``MoeModelOutputWithPast`` for Qwen3-MoE), so every caller of the Hugging Face module (the
``*ForCausalLM`` forward with or without ``labels``, ``generate``, a trainer) gets the fields it reads. Of the
outputs the class can record, ``hidden_states`` (the input of every layer plus the final-norm output) and
``router_logits`` (per sparse layer fp32 [batch * seq, experts], padding rows 0; the ``*ForCausalLM`` adds its
``aux_loss`` from them) are computed; ``output_attentions`` and a list of layers are refused. It keeps no KV
cache: the patch sets ``config.use_cache = False``, and a KV cache or ``use_cache=True`` is refused (roll out
with rlalign's engine, or ``generate(..., use_cache=False)``, which also works on right-padded prompts;
``generate(inputs_embeds=...)`` always makes transformers use a cache and is refused). The attention
and (MoE) experts implementations read ``"rlalign"`` while patched: ``set_attn_implementation`` /
``set_experts_implementation`` to anything else is refused, and so is a forward after the config was switched
by hand. Taps (:mod:`rlalign.models.taps`) are the block cores' own, so they have rlalign's names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import types
from typing import Any

import torch
from torch import nn

from rlalign import ops
from rlalign.contract.errors import RLAlignError
from rlalign.contract.profiles import Profile, as_profile, use_profile
from rlalign.models import architectures
from rlalign.models.batch import ForwardBatch
from rlalign.models.checkpoint import load_model_config, resolve_dtype
from rlalign.models.blocks import attention_block, decoder_layer_block, final_norm_block, rope_inv_freq
from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.models.decoder import Attention, DecoderLayer
from rlalign.models.modules import Linear, RMSNorm
from rlalign.models.moe import SparseMoE, record_routing, sparse_layer_indices, sparse_moe_block, stacked_expert_ffns
from rlalign.models.taps import EMBED, LOGPROB, note_batch, tap
from rlalign.integrations import peft_lora

ATTENTION = "rlalign"
_STATE = "_rlalign_patch"


class UnsupportedModelError(RLAlignError, ValueError):
    """The model cannot be patched (architecture, config feature, dtype or module layout)."""


class UnsupportedInputError(RLAlignError, ValueError):
    """The patched model was asked for something it does not compute under the contract (an input, an output,
    a KV cache, another attention implementation)."""


@dataclasses.dataclass
class PatchState:
    profile: Profile
    config: ModelConfig
    inv_freq: torch.Tensor            # float64 inverse frequencies on the CPU (a plain attribute: never cast by .to())
    previous_attention: str | None
    previous_experts: str | None      # config._experts_implementation before the patch (MoE models)
    previous_use_cache: Any
    patched: list[tuple[nn.Module, str]]   # (module, method name) of every instance method the patch set
    # (decoder layer, path, module) of every projection bound: a module replaced later (e.g. PEFT wrapping the
    # patched model) would run its own, unpatched forward, so each forward checks they are still in place
    linears: list[tuple[nn.Module, str, nn.Module]] = dataclasses.field(default_factory=list)


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
    positions, cu = _sequences(positions, index, s)
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


def _sequences(positions: torch.Tensor, index: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, cu_seqlens int32) of the packed valid rows (``index``: flat b * width + s of each).

    A sequence starts at each input row's first valid token and wherever the position is 0; every
    other token must continue its sequence (position + 1) -- except right after padding, whose
    positions do not count (transformers' generate() counts them on right-padded prompts). Positions
    are then recounted 0, 1, 2, ... from each start, so padding never shifts a token's rotary position.
    """
    row, col = index // width, index % width
    n = positions.numel()
    first_in_row = torch.ones(n, dtype=torch.bool, device=positions.device)
    after_gap = col > 0                    # a row's first valid token: padding before it
    if n > 1:
        first_in_row[1:] = row[1:] != row[:-1]
        after_gap[1:] = torch.where(first_in_row[1:], col[1:] > 0, index[1:] != index[:-1] + 1)
    follows = torch.zeros_like(first_in_row)
    follows[1:] = positions[1:] == positions[:-1] + 1
    starts = first_in_row | (positions == 0)
    ok = (positions == 0) | after_gap | (follows & ~first_in_row)
    if not bool(ok.all()):
        t = int((~ok).nonzero()[0])
        raise UnsupportedInputError(
            f"input row {int(row[t])}, column {int(col[t])} has position {int(positions[t])} but neither starts a "
            "sequence nor continues one: positions must count 0, 1, 2, ... within each sequence (every sequence "
            "starts at position 0)")
    first = starts.nonzero().flatten()
    arange = torch.arange(n, dtype=torch.int64, device=positions.device)
    start_of = torch.cummax(torch.where(starts, arange, torch.zeros_like(arange)), 0).values
    total = torch.tensor([n], dtype=first.dtype, device=first.device)
    return arange - start_of, torch.cat([first, total]).to(torch.int32)


# ---- adapters: transformers' modules made callable by rlalign's block cores (bound per instance) ----------

def _linear_forward(self, x):
    return ops.linear(x, self.weight, self.bias, k_segments=self._rlalign_k_segments)


def _norm_forward(self, x, residual=None):
    """rlalign's RMSNorm contract: normed, or (normed(x + residual), x + residual) with the add rounded once."""
    return ops.rms_norm(x, self.weight, self._rlalign_eps, residual=residual)


def _embedding_forward(self, ids):
    return ops.embedding(ids, self.weight)


def _attention_forward(self, x, cos, sin, attend):
    cfg = self._rlalign_config
    return attention_block(self, x, cos, sin, attend, layer=self.layer_idx, num_heads=cfg.num_heads,
                           num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, qk_norm=cfg.qk_norm)


def _layer_forward(self, h, residual=None, *, rlalign_rope=None, rlalign_batch: ForwardBatch | None = None, **kwargs):
    """(h, residual) -> (FFN output, residual stream), rlalign's DecoderLayer on packed rows [T, hidden]."""
    if rlalign_batch is None:
        raise UnsupportedInputError("a patched decoder layer must be called by its patched model")
    cos, sin = rlalign_rope
    attend = _interface_attend(self.self_attn, rlalign_batch)
    return decoder_layer_block(self, h, residual, lambda x: self.self_attn(x, cos, sin, attend),
                               self.self_attn.layer_idx)


def _interface_attend(attn: nn.Module, batch: ForwardBatch):
    """Attention of the packed rows through transformers' AttentionInterface ("rlalign": ops.attention_varlen)."""
    cu = batch.cu_seqlens

    def heads_first(x):
        return x.transpose(0, 1).unsqueeze(0)

    def attend(q, k, v, layer: int, scale: float) -> torch.Tensor:
        out, _ = _attention_function()(attn, heads_first(q), heads_first(k), heads_first(v), None, scaling=scale,
                                       dropout=0.0, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        return out[0]
    return attend



# transformers keeps an FFN kind's weights in its own runtime layout where that differs from the checkpoint's:
# Qwen3-MoE stacks the experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) and
# routes in a ``gate`` module holding ``weight`` [E, H]. The adapter hands views of those to the block core.

def _sparse_moe_forward(self, x):
    inter = self.experts.down_proj.shape[-1]
    gate_up = self.experts.gate_up_proj
    ffns = stacked_expert_ffns(gate_up[:, :inter], gate_up[:, inter:], self.experts.down_proj)
    return sparse_moe_block(x, self.gate.weight, ffns, top_k=self._rlalign_top_k, normalize=self._rlalign_normalize,
                            layer=self._rlalign_layer)


def checkpoint_parameters(model: nn.Module):
    """(name, tensor) of every parameter under the checkpoint's names and layouts: transformers' stacked
    experts (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) as the per-expert
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` views the checkpoint holds; everything else as it is."""
    for name, p in model.named_parameters():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, inter = name[:-len("gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", p[e, :inter]
                yield f"{prefix}{e}.up_proj.weight", p[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for e in range(p.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", p[e]
        else:
            yield name, p

def _check_sparse_moe(theirs: nn.Module, ours: SparseMoE, where: str, need) -> None:
    gate, experts = getattr(theirs, "gate", None), getattr(theirs, "experts", None)
    n, hidden = ours.gate.weight.shape
    inter = ours.experts.inter
    want = {"gate.weight": (n, hidden), "experts.gate_up_proj": (n, 2 * inter, hidden),
            "experts.down_proj": (n, hidden, inter)}
    found = {"gate.weight": getattr(gate, "weight", None), "experts.gate_up_proj": getattr(experts, "gate_up_proj", None),
             "experts.down_proj": getattr(experts, "down_proj", None)}
    for name, shape in want.items():
        t = found[name]
        need(isinstance(t, torch.Tensor) and tuple(t.shape) == shape,
             f"{where}.{name}: expected shape {shape}, found {None if t is None else tuple(t.shape)}")
    need(getattr(gate, "top_k", ours.top_k) == ours.top_k
         and bool(getattr(gate, "norm_topk_prob", ours.normalize)) == ours.normalize,
         f"{where}.gate: top_k / norm_topk_prob differ from the config")

def _backbone_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                      inputs_embeds=None, use_cache=None, return_dict=None, cache_position=None, cache=None, **kwargs):
    """The patched backbone: what the module's own forward returns (its annotated output class, the outputs its
    class can record), computed by rlalign on the packed valid tokens."""
    state: PatchState = getattr(self, _STATE)
    _check_pinned_kernels(self.config, _pinned(state.config))
    _check_cache(self.config, past_key_values if past_key_values is not None else cache, use_cache, inputs_embeds)
    wanted = _requested_outputs(self, kwargs)
    if (input_ids is None) == (inputs_embeds is None):
        raise UnsupportedInputError("pass exactly one of input_ids and inputs_embeds")
    ref = input_ids if input_ids is not None else inputs_embeds
    layout = _layout(tuple(ref.shape[:2]), ref.device, input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids, cu_seq_lens=kwargs.get("cu_seq_lens_q"))
    embeds = layout.pack(inputs_embeds) if inputs_embeds is not None else None
    with use_profile(state.profile), _routing_record(wanted["router_logits"]) as record:
        hidden, per_layer = _packed_hidden(self, state, layout.batch, embeds, wanted["hidden_states"])
    fields = {"last_hidden_state": layout.unpack(hidden)}
    if wanted["hidden_states"]:
        fields["hidden_states"] = tuple(layout.unpack(h) for h in per_layer)
    if record is not None:
        fields["router_logits"] = _router_logits(record, layout)
    out = _output_class(type(self))(**fields)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return out if return_dict else out.to_tuple()


# Outputs a transformers backbone records (``_can_record_outputs``) that the patched backbone computes too;
# asking for any other one is refused, with the reason below when there is one.
COMPUTED_OUTPUTS = ("hidden_states", "router_logits")
NOT_COMPUTED = {"attentions": "its attention is rlalign's fused kernel, which returns no attention weights"}


def _requested_outputs(backbone, kwargs: dict) -> dict[str, bool]:
    """Which recordable outputs the call asks for (``output_<name>`` argument, else the config), as
    transformers' ``capture_outputs`` reads them; refuses one the patched model does not compute (one line)."""
    names = set(getattr(type(backbone), "_can_record_outputs", None) or ()) | {"hidden_states", "attentions"}
    wanted = {name: False for name in COMPUTED_OUTPUTS}
    for name in sorted(names):
        value = kwargs.pop(f"output_{name}", None)
        if value is None:
            value = getattr(backbone.config, f"output_{name}", False)
        if not value:
            continue
        if name not in COMPUTED_OUTPUTS:
            why = NOT_COMPUTED.get(name, f"it does not compute {name}")
            raise UnsupportedInputError(f"output_{name}=True is not supported by the rlalign-patched model ({why})")
        if isinstance(value, (list, tuple, set)):
            raise UnsupportedInputError(f"output_{name}={sorted(value)}: a list of layers is not supported by the "
                                        f"rlalign-patched model; pass output_{name}=True and index the tuple")
        wanted[name] = True
    return wanted


def _check_cache(config, cache, use_cache, inputs_embeds) -> None:
    """Refuse a KV cache (one line each, with the advice that applies to the call)."""
    if cache is not None and inputs_embeds is not None:
        raise UnsupportedInputError("generate() from inputs_embeds is not supported by the rlalign-patched model: "
                                    "transformers generates from embeddings only with a KV cache, which the patched "
                                    "model does not keep; generate from input_ids with use_cache=False, or roll out "
                                    "with rlalign's RolloutEngine")
    if cache is not None:
        raise UnsupportedInputError("the rlalign-patched model does not run with a KV cache (generation): roll out "
                                    "with rlalign's RolloutEngine, or call generate(..., use_cache=False)")
    if use_cache if use_cache is not None else getattr(config, "use_cache", False):
        raise UnsupportedInputError("use_cache=True: the rlalign-patched model keeps no KV cache; pass "
                                    "use_cache=False (generate(..., use_cache=False)) or roll out with rlalign's engine")


# Kernel choices transformers lets a user switch at run time (config attribute, PreTrainedModel setter). The
# patched model always runs rlalign's: the patch sets them to "rlalign" (experts: on MoE models), refuses the
# setter for anything else and refuses a forward after the attribute was changed by hand, so the config never
# names a kernel that does not run.
PINNED_KERNELS = {"attention": ("_attn_implementation", "set_attn_implementation"),
                  "experts": ("_experts_implementation", "set_experts_implementation")}


def _pinned(config: ModelConfig) -> tuple[str, ...]:
    """The kernel choices the patch pins for this model: attention, and the experts of a MoE model."""
    return ("attention", "experts") if sparse_layer_indices(config) else ("attention",)


def _check_pinned_kernels(config, pinned: tuple[str, ...]) -> None:
    """Refuse a forward whose config names another kernel than the one that runs (one line)."""
    for what in pinned:
        attr = PINNED_KERNELS[what][0]
        name = getattr(config, attr, ATTENTION)
        if name != ATTENTION:
            raise UnsupportedInputError(f"config.{attr} was set to {name!r}, but the rlalign-patched model always runs "
                                        f"rlalign's {what}: call unpatch(model) before switching it")


def _refuse_kernel_switch(what: str, setter: str):
    """The instance ``setter`` (``set_attn_implementation`` ...) of a patched model: only "rlalign" is accepted."""
    def refuse(self, implementation, *args, **kwargs):
        names = set(implementation.values()) if isinstance(implementation, dict) else {implementation}
        if names - {ATTENTION}:
            raise UnsupportedInputError(f"{setter}({implementation!r}): the rlalign-patched model always runs "
                                        f"rlalign's {what}; call rlalign.integrations.transformers.unpatch(model) "
                                        "first to use another implementation")
    return refuse


@contextlib.contextmanager
def _routing_record(wanted: bool):
    """rlalign's routing record around the forward when the router logits are asked for, else None."""
    if not wanted:
        yield None
        return
    with record_routing(keep_logits=True) as record:
        yield record


def _router_logits(record, layout: _Layout) -> tuple[torch.Tensor, ...]:
    """transformers' ``router_logits``: per sparse layer, fp32 [B * S, num_experts] (rows of padding 0)."""
    b, s = layout.shape
    out = []
    for layer in record.layer_indices:
        logits = torch.cat([entry[0] for entry in record.layers[layer]])
        out.append(layout.unpack(logits).reshape(b * s, -1))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _output_class(backbone_class: type):
    """The output class the backbone class's own forward is annotated with (BaseModelOutputWithPast if none)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast  # lazy: heavy
    from transformers.utils import ModelOutput  # lazy: heavy

    annotation = inspect.signature(backbone_class.forward).return_annotation
    if isinstance(annotation, type) and issubclass(annotation, ModelOutput):
        return annotation
    return BaseModelOutputWithPast


def _packed_hidden(backbone, state: PatchState, batch: ForwardBatch, embeds=None, keep_layers: bool = False):
    """Final-norm hidden rows [T, hidden] of a packed batch: rlalign's forward_hidden, on HF modules.
    With ``keep_layers``, also transformers' hidden_states: each layer's input, then the final-norm output."""
    _check_linears(state)
    note_batch(batch)
    h = backbone.embed_tokens(batch.input_ids) if embeds is None else embeds
    tap(EMBED, h)
    rope = ops.rope_cos_sin(batch.positions, state.inv_freq.to(batch.positions.device))
    per_layer = [h] if keep_layers else []
    residual = None
    for layer in backbone.layers:
        h, residual = layer(h, residual, rlalign_rope=rope, rlalign_batch=batch)
        if keep_layers:
            per_layer.append(h + residual)   # transformers' layer output: one IEEE add, as the next norm makes
    h = final_norm_block(backbone.norm, h, residual)
    if keep_layers:
        per_layer[-1] = h  # transformers' convention: the last entry is after the final norm
    return h, per_layer


# ---- public API --------------------------------------------------------------------------------------------

def patch(model: nn.Module, profile: str | Profile = "strict") -> nn.Module:
    """Make ``model`` (the ``*ForCausalLM`` of a registered family) compute with rlalign ops under
    ``profile``; returns it.

    Patching twice only changes the profile. Raises :class:`UnsupportedModelError` for any other
    model class, config feature or parameter dtype (strict: float32 / bfloat16). Sets
    ``config.use_cache = False`` (restored by :func:`unpatch`).
    """
    profile = as_profile(profile)
    outer, model = model, peft_lora.unwrap(model)   # a PeftModel: its *ForCausalLM, adapters included
    state = getattr(model, _STATE, None)
    if state is not None and _replaced_linear(state) is None:
        state.profile = profile
        return outer
    if state is not None:   # wrapped (e.g. by PEFT) after it was patched: patch the new modules too
        unpatch(model)
    config = _check_supported(model, profile)
    register_attention()
    previous = getattr(model.config, "_attn_implementation", None)
    _set_attention(model, ATTENTION)
    experts = getattr(model.config, "_experts_implementation", None)
    state = PatchState(profile, config, rope_inv_freq(config), previous, experts,
                       getattr(model.config, "use_cache", None), [])
    if sparse_layer_indices(config):
        model.config._experts_implementation = ATTENTION   # the sparse blocks run rlalign's experts
    model.config.use_cache = False
    _patch_modules(model, state)
    object.__setattr__(model, _STATE, state)
    object.__setattr__(model.model, _STATE, state)
    return outer


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch` (the modules' class forwards and the previous attention implementation return)."""
    outer, model = model, peft_lora.unwrap(model)
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    for module, method in state.patched:
        module.__dict__.pop(method, None)
    if state.previous_attention:
        _set_attention(model, state.previous_attention)
    if sparse_layer_indices(state.config):
        model.config._experts_implementation = state.previous_experts
    model.config.use_cache = state.previous_use_cache
    for obj in (model, model.model):
        obj.__dict__.pop(_STATE, None)
    return outer


def is_patched(model: nn.Module) -> bool:
    return getattr(peft_lora.unwrap(model), _STATE, None) is not None


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
                   vocab_chunk: int | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                   sampled: dict | None = None) -> TokenLogprobs:
    """Per-token logprobs (and entropy) of a patched model, differentiable, without full logits.

    ``logprobs[b, s] = log softmax(h[b, s] @ W_lm.T / temperature)[target]`` computed by
    ``ops.logprob_entropy`` on the packed valid rows (the same rows, bits and gradients as rlalign's
    ``CausalLM.logprobs`` on the packed batch of the same sequences). Default target of (b, s): the
    next token of the same sequence (``input_ids[b, s+1]`` for a padded row); explicit ``targets``
    [B, S] are used as given. Inputs as for the model: padded (2-D ``attention_mask``) or packed
    (``position_ids`` restarting at 0, or ``cu_seq_lens_q``).

    ``sampled``: ``ops.sampled_logprob``'s settings (``temperature``, ``top_k``, ``top_p``, ``min_p``; strict):
    the log-prob (and entropy) of the kept set's renormalised distribution the rlalign engine sampled from with
    ``SamplingParams(logprobs="sampled")``, the same bits as rlalign's trainer (``temperature=`` is then unused).
    """
    model = peft_lora.unwrap(model)
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
        if sampled is not None:
            lp, ent = ops.sampled_logprob(hidden, model.lm_head.weight, rows, with_entropy=with_entropy, **sampled)[:2]
        else:
            lp, ent = ops.logprob_entropy(hidden, model.lm_head.weight, rows, temperature=temperature,
                                          with_entropy=with_entropy, token_chunk=token_chunk, vocab_chunk=vocab_chunk)
    tap(LOGPROB, lp)
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
    """The module's class picks the family (the registry's *ForCausalLM); its config must parse as that family."""
    name = type(model).__name__
    family = architectures.by_architecture(name)
    if family is not None and family.architecture == name and not family.integrations:
        raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name} is not supported by the patch "
                                    "yet; load the checkpoint with rlalign.models.load_model")
    if family is None or family.architecture != name:
        hint = " (patch the base model before wrapping it, e.g. with PEFT)" if hasattr(model, "base_model") else ""
        raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name} is not supported; supported: "
                                    f"{', '.join(architectures.integration_architectures())}{hint}")
    d = model.config.to_dict()
    if d.get("model_type") != family.model_type:
        raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name}: config model_type "
                                    f"{d.get('model_type')!r} is not {family.model_type!r}")
    d["architectures"] = [family.architecture]   # the class decides (a headless checkpoint names *Model)
    try:
        config = ModelConfig.from_hf_dict(d)
    except ModelConfigError as exc:
        raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name}: {exc}") from None
    if float(getattr(model.config, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name}: attention_dropout="
                                    f"{model.config.attention_dropout} is not supported (set it to 0)")
    _check_modules(model, name, config, profile)
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1 or (profile is Profile.STRICT and not dtypes <= {torch.float32, torch.bfloat16}):
        raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name}: parameters must share one "
                                    f"dtype, float32 or bfloat16 in strict; got {sorted(map(str, dtypes))}")
    return config


def _reference_layer(config: ModelConfig, index: int) -> DecoderLayer:
    """rlalign's decoder layer for ``config`` on the meta device: the structure (names, shapes, which linear
    reduces over the canonical K partition, which FFN kind) that the Hugging Face layer must match."""
    return DecoderLayer(config, index, torch.float32, "meta")


def _check_modules(model, name: str, config: ModelConfig, profile: Profile) -> None:
    def need(cond: bool, what: str):
        if not cond:
            raise UnsupportedModelError(f"rlalign.integrations.transformers.patch: {name}: {what}")

    backbone = getattr(model, "model", None)
    need(backbone is not None and hasattr(backbone, "layers") and hasattr(backbone, "embed_tokens")
         and hasattr(backbone, "norm"), "expected model.model with embed_tokens, layers and norm")
    need(isinstance(getattr(model, "lm_head", None), nn.Linear), "expected an nn.Linear lm_head")
    need(len(backbone.layers) == config.num_layers, "the number of layers does not match the config")
    for i, layer in enumerate(backbone.layers):
        for path, ours in _modules_to_bind(_reference_layer(config, i)):
            theirs = _submodule(layer, path)
            where = f"layers.{i}.{path}"
            need(theirs is not None, f"{where} is missing")
            if isinstance(ours, SparseMoE):
                _check_sparse_moe(theirs, ours, where, need)
                continue
            if isinstance(ours, Linear) and peft_lora.is_lora_layer(theirs):   # PEFT's LoRA: checked, then its base
                problem = peft_lora.layer_problem(theirs, profile)
                need(problem is None, f"{where} (a PEFT LoRA layer): {problem}")
                theirs = theirs.base_layer
            if isinstance(ours, Linear):
                need(type(theirs) is nn.Linear, f"{where} is not a plain nn.Linear or a PEFT LoRA layer over one "
                     "(quantized layers are not supported)")
            for pname, p in ours.named_parameters(recurse=False):
                mine = getattr(theirs, pname, None)
                need(mine is not None and tuple(mine.shape) == tuple(p.shape),
                     f"{where}.{pname}: expected shape {tuple(p.shape)}, found "
                     f"{None if mine is None else tuple(mine.shape)}")
            if isinstance(ours, Linear):
                need(ours.bias is not None or theirs.bias is None, f"{where} has a bias the family does not have")
        attn = layer.self_attn
        need(getattr(attn, "sliding_window", None) is None, f"layer {i} uses sliding-window attention")
        need(getattr(attn, "layer_idx", None) == i, f"layer {i}: unexpected self_attn.layer_idx")


def _modules_to_bind(reference: DecoderLayer):
    """(path, module) of the reference layer, a sparse MoE block as one unit (its Hugging Face layout differs)."""
    skip = None
    for path, module in reference.named_modules():
        if skip is not None and path.startswith(skip):
            continue
        skip = f"{path}." if isinstance(module, SparseMoE) else skip
        yield path, module


def _submodule(root: nn.Module, path: str):
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None


def _replaced_linear(state: PatchState) -> "str | None":
    """The first bound projection no longer at its place in its decoder layer (None: all in place)."""
    for layer, path, module in state.linears:
        if _submodule(layer, path) is not module:
            return f"layers.{layer.self_attn.layer_idx}.{path}"
    return None


def _check_linears(state: PatchState) -> None:
    replaced = _replaced_linear(state)
    if replaced is not None:
        raise UnsupportedModelError(f"{replaced} was replaced after patch() (e.g. PEFT wrapped the patched model), so "
                                    "it would run unpatched ops: call patch() again on the wrapped model")


def _set_attention(model, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except (AttributeError, ValueError, KeyError):
        model.config._attn_implementation = name
    if getattr(model.config, "_attn_implementation", None) != name:
        model.config._attn_implementation = name


def _bind(module: nn.Module, fn, state: PatchState, method: str = "forward", **attrs: Any) -> None:
    """Set the instance method ``method`` of ``module`` to ``fn`` (undone by :func:`unpatch`)."""
    for key, value in attrs.items():
        object.__setattr__(module, f"_rlalign_{key}", value)
    setattr(module, method, types.MethodType(fn, module))
    state.patched.append((module, method))


def _norm_eps(norm: nn.Module, default: float) -> float:
    for attr in ("variance_epsilon", "eps"):
        if getattr(norm, attr, None) is not None:
            return float(getattr(norm, attr))
    return default


def _patch_modules(model, state: PatchState) -> None:
    """Rebind each Hugging Face module to the rlalign module at the same path of the reference layer:
    linears and norms to their ops (with the reference's k_segments), the attention to the block core,
    the FFN to its kind's own forward (a block core reading only the children), the layer to the layer core."""
    config, backbone = state.config, model.model
    _bind(backbone.embed_tokens, _embedding_forward, state)
    for i, layer in enumerate(backbone.layers):
        reference = _reference_layer(config, i)
        for path, ours in _modules_to_bind(reference):
            theirs = _submodule(layer, path)
            if isinstance(ours, SparseMoE):
                _bind(theirs, _sparse_moe_forward, state, top_k=ours.top_k, normalize=ours.normalize, layer=i)
            elif isinstance(ours, Linear):
                lora = peft_lora.is_lora_layer(theirs)
                _bind(theirs, peft_lora.lora_forward if lora else _linear_forward, state, k_segments=ours.k_segments)
                state.linears.append((layer, path, theirs))
            elif isinstance(ours, RMSNorm):
                _bind(theirs, _norm_forward, state, eps=_norm_eps(theirs, ours.eps))
            elif isinstance(ours, Attention):
                _bind(theirs, _attention_forward, state, config=config)
            elif isinstance(ours, DecoderLayer):
                _bind(theirs, _layer_forward, state)
            elif ours is reference.mlp:
                _bind(theirs, type(ours).forward, state)
    _bind(backbone.norm, _norm_forward, state, eps=_norm_eps(backbone.norm, config.rms_norm_eps))
    _bind(model.lm_head, _linear_forward, state, k_segments=None)
    _bind(backbone, _backbone_forward, state)
    for what in _pinned(config):
        setter = PINNED_KERNELS[what][1]
        for owner in (model, backbone):
            _bind(owner, _refuse_kernel_switch(what, setter), state, method=setter)


__all__ = ["patch", "unpatch", "checkpoint_parameters", "is_patched", "from_pretrained", "token_logprobs", "TokenLogprobs",
           "rlalign_attention", "register_attention", "UnsupportedModelError", "UnsupportedInputError",
           "ATTENTION"]
