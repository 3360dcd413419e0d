"""The memory budget of a training run, per component and place (GPU, host, disk), from tensor sizes.

    python -m rlalign.train.budget CONFIG.yaml [section.key=value ...] [--model-config config.json]
                                   [--device-memory GIB]

Places: ``device`` (the model's device: the GPU, or the CPU), ``host``, ``disk``.
Arithmetic, not a measurement (``memory/peak_mb`` in metrics.jsonl and benchmarks/train_step.py measure):
P is the policy's exact parameter count (the model built on the meta device), b the bytes of its
dtype. What each component holds, as the trainer (rlalign.train.loop, update.py, master.py) allocates it:

    policy weights, gradients          P b each, on the device
    fp32 master weights                4 P (every low-precision parameter; every parameter with
                                       optim.offload), on the host with optim.offload
    AdamW m, v                         8 P next to the masters (2 b P on the device without masters)
    optimizer step working set         12 N next to the masters, N = min(the largest parameter's size,
                                       optim.step_chunk_elements): MasterWeights.step goes one parameter
                                       and one chunk of it at a time, holding the chunk's widened fp32
                                       gradient (4 N) and AdamW's two fp32 temporaries of sqrt(v) / bias
                                       correction (8 N; the chunk's rounding into the model, b N, comes
                                       after they are freed); without masters 2 b N (the same two
                                       temporaries in the parameter dtype)
    rollout engine weights             0 when the engine shares the policy's tensors
                                       (rlalign.train.engines.weights_path), else P b (its own copy)
    reference model                    P b with algo.kl_coef > 0
    KV cache                           rollout.kv_cache_bytes; unset: the step's sequences x
                                       (prompt + max_new_tokens, or max_episode_tokens) x 2 L Hkv D b,
                                       what the trainer's engine gets on a GPU (engines.step_kv_cache_bytes)
    activations                        optim.micro_batch_tokens x bytes per token: with activation
                                       checkpointing the 2 H b of each layer's saved inputs (hidden,
                                       residual) x L plus one layer recomputed; without, the upper
                                       bound of every tensor a layer may keep (see _layer_bytes_per_token)
    fused log-prob working set         three fp32 [token_chunk, vocab_chunk] tiles
    log-prob backward LM-head gradient (4 + b) V H: the fused log-prob's backward accumulates the LM
                                       head's weight gradient in fp32 over the whole vocabulary, then
                                       casts it (both live for a moment), every micro-batch
    parallel.shard=grads               each of the parallel.dp ranks (N) holds ceil(P / N) of the masters and
                                       AdamW state (and of the step's working set); the gradients stay P b
                                       (each rank accumulates its micro-batches' full gradient before the
                                       reduction); a save streams each rank's part (rlalign.train.sharding)
    parallel.shard=params              and the weights: ceil(P / N) b per rank, plus what is gathered whole
                                       (rlalign.train.weight_shards): with the engine reading the policy's
                                       tensors, the whole weights during each rollout; in the update the
                                       embeddings, final norm and LM head, and at most two decoder layers
    checkpoint file                    masters + AdamW state (12 P; a weight with a master is stored only
                                       as the master), or weights + AdamW state (3 b P) without masters;
                                       streamed to disk (save_checkpoint): the host holds at most one
                                       device tensor's copy at a time (nothing when the state is on the
                                       host); on disk max(run.keep_checkpoints, 2) files during a save (the
                                       new one is written before the last old one is deleted); none
                                       with run.save_checkpoints=false
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import torch

from rlalign.contract.errors import RLAlignError
from rlalign.contract.spec import DEFAULT_TOKEN_CHUNK, DEFAULT_VOCAB_CHUNK
from rlalign.models.checkpoint import read_config_json
from rlalign.models.config import ModelConfig
from rlalign.models.sizes import kv_bytes_per_token, parameter_shapes, parameter_sizes
from rlalign.train.engines import PROMPT_TOKENS_ESTIMATE, kv_continuation, step_kv_cache_bytes, weights_path
from rlalign.train.run.config_file import resolve_train_config

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class BudgetRow:
    component: str
    place: str        # "device" | "host" | "disk" (the model's device is "device" also when it is the CPU)
    nbytes: int
    note: str = ""


def parameter_count(model_config: ModelConfig) -> int:
    return sum(parameter_sizes(model_config))


def _layer_bytes_per_token(m: ModelConfig, b: int) -> int:
    """Upper bound of what one decoder layer keeps for backward per token: the two norms' inputs and
    outputs (4 H), the attention residual and output projection input (2 H), q, k (before and after
    q/k-norm and rope: 2 (Hq + Hkv) D), v (Hkv D), the attention output (Hq D) and its fp32 row
    log-sum-exp (Hq), gate, up and their product (3 I)."""
    hq, hkv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    elems = 6 * m.hidden_size + 2 * (hq + hkv) + hkv + hq + 3 * m.intermediate_size
    return b * elems + 4 * m.num_heads


def activation_bytes_per_token(m: ModelConfig, b: int, checkpointing: bool) -> int:
    layer = _layer_bytes_per_token(m, b)
    if checkpointing:
        return m.num_layers * 2 * m.hidden_size * b + layer
    return m.num_layers * layer


class BudgetError(RLAlignError):
    """A run whose memory budget exceeds the machine (:func:`refuse_what_cannot_fit`)."""


def memory_budget(cfg, model_config: ModelConfig) -> list[BudgetRow]:
    """The rows of ``cfg`` (a TrainConfig) for a policy of ``model_config``."""
    dtype = cfg.model.dtype or model_config.dtype
    b = _DTYPE_BYTES.get(str(dtype).replace("torch.", ""), 4)
    sizes = parameter_sizes(model_config)
    p, largest = sum(sizes), max(sizes)
    o = cfg.optim
    masters = o.master_weights and (b != 4 or o.offload)
    state_place = "host" if masters and o.offload else "device"
    ranks = cfg.parallel.dp if cfg.parallel.shard in ("grads", "params") else 1   # a 1/N range per rank
    held = -(-p // ranks)
    if cfg.parallel.shard == "params":   # rlalign.train.weight_shards: the weights in ranges, units gathered
        layer, outer = _gathered_units(model_config)
        units = (outer + 2 * layer) * b
        rows = [BudgetRow("policy weights", "device", held * b,
                          f"{p / 1e9:.3f}B parameters x {b} B; this rank's 1/{ranks} (parallel.shard=params)")]
        if weights_path(cfg).shared:   # the engine reads them in place: gathered whole for each rollout
            rows.append(BudgetRow("gathered weights", "device", max((p - held) * b, units),
                                  "the rest of the weights, whole during each rollout (gradients and activations "
                                  f"are not live then); in the update {_size(units)}: embeddings, final norm and "
                                  "LM head + two decoder layers"))
        else:
            rows.append(BudgetRow("gathered weights", "device", units, "embeddings, final norm and LM head for the "
                                  "step + two decoder layers (parallel.shard=params)"))
    else:
        rows = [BudgetRow("policy weights", "device", p * b, f"{p / 1e9:.3f}B parameters x {b} B")]
    rows.append(BudgetRow("policy gradients", "device", p * b, "model dtype"))
    chunk = min(largest, held, o.step_chunk_elements)
    stepped = (f"one parameter and at most {_count(o.step_chunk_elements)} of its elements at a time "
               f"(optim.step_chunk_elements; the largest parameter has {_count(largest)})")
    share = f"; this rank's 1/{ranks} (parallel.shard={cfg.parallel.shard})" if ranks > 1 else ""
    if masters:
        rows += [BudgetRow("fp32 master weights", state_place, 4 * held, "optim.master_weights" + share),
                 BudgetRow("AdamW m, v (fp32)", state_place, 8 * held, share.removeprefix("; ")),
                 BudgetRow("optimizer step working set", state_place, 12 * chunk,
                           f"{stepped}: fp32 gradient + 2 AdamW temporaries")]
    else:
        rows += [BudgetRow("AdamW m, v", "device", 2 * b * held, "parameter dtype" + share),
                 BudgetRow("optimizer step working set", "device", 2 * b * chunk, f"{stepped}: 2 AdamW temporaries")]
    path = weights_path(cfg)
    rows.append(BudgetRow("rollout engine weights", "device", 0 if path.shared else p * b,
                          "shared with the policy (no copy)" if path.shared else f"its own copy: {path.reason}"))
    if cfg.algo.kl_coef > 0:
        rows.append(BudgetRow("reference model", "device", p * b, "algo.kl_coef > 0"))
    if cfg.algo.advantage == "gae":
        rows.append(BudgetRow("value model", "device", 16 * p, "a second trunk, fp32 AdamW state"))
    head = model_config.vocab_size * model_config.hidden_size
    rows += [_kv_row(cfg, model_config, b), _activation_row(cfg, model_config, b),
             BudgetRow("fused log-prob working set", "device", 3 * 4 * DEFAULT_TOKEN_CHUNK * DEFAULT_VOCAB_CHUNK,
                       f"3 fp32 [{DEFAULT_TOKEN_CHUNK}, {DEFAULT_VOCAB_CHUNK}] tiles"),
             BudgetRow("log-prob backward LM-head gradient", "device", (4 + b) * head,
                       f"fp32 accumulation over the vocabulary + its {b}-byte cast, in backward")]
    return rows + _checkpoint_rows(cfg, p, largest, b, masters, state_place, ranks > 1)


def _gathered_units(model_config: ModelConfig) -> tuple[int, int]:
    """(elements of the largest decoder layer, elements outside the decoder layers): what parallel.shard=params
    gathers whole per layer and for the step."""
    layers, outer = {}, 0
    for name, shape in parameter_shapes(model_config):
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            layers[index] = layers.get(index, 0) + math.prod(shape)
        else:
            outer += math.prod(shape)
    return max(layers.values(), default=0), outer


def _checkpoint_rows(cfg, p: int, largest: int, b: int, masters: bool, state_place: str,
                     sharded: bool = False) -> list[BudgetRow]:
    """What a save costs: the stream's host copy of one device tensor (with sharding: the state gathered on the
    writer), and the files on disk."""
    ckpt, what = (12 * p, "masters + AdamW state") if masters else (3 * b * p, "weights + AdamW state")
    copy = 0 if state_place == "host" else largest * (4 if masters else b)
    if sharded:   # each rank streams its own part; the main file holds the model weights
        ckpt, what = ckpt + (b * p if masters else 0), what + " in one part per rank, + the weights"
    keep = cfg.run.keep_checkpoints
    files = max(keep, 2)
    if not cfg.run.save_checkpoints:
        return [BudgetRow("checkpoint files", "disk", 0, f"run.save_checkpoints=false (one would be {_size(ckpt)})"),
                BudgetRow("exported policy", "disk", p * b, "Hugging Face safetensors at the end")]
    return [BudgetRow("checkpoint save, host copy", "host", copy,
                      "streamed: the state is on the host already" if copy == 0 else
                      "streamed: one device tensor at a time, the largest"),
            BudgetRow("checkpoint files", "disk", files * ckpt,
                      f"{_size(ckpt)} each ({what}); run.keep_checkpoints={keep}: {files} during a save"),
            BudgetRow("exported policy", "disk", p * b, "Hugging Face safetensors at the end")]


def _kv_row(cfg, m: ModelConfig, b: int) -> BudgetRow:
    r = cfg.rollout
    per_token = kv_bytes_per_token(m, b)
    if r.kv_cache_bytes is not None:
        return BudgetRow("KV cache (rollout)", "device", r.kv_cache_bytes,
                         f"rollout.kv_cache_bytes; {per_token / 1024:.0f} KiB per token")
    seqs = r.prompts_per_step * r.samples_per_prompt
    return BudgetRow("KV cache (rollout)", "device", step_kv_cache_bytes(cfg, m, b),
                     f"{seqs} sequences x ({PROMPT_TOKENS_ESTIMATE} + {kv_continuation(cfg)}) tokens x "
                     f"{per_token / 1024:.0f} KiB (unset kv_cache_bytes: the engine's size on a GPU; 1 GiB on the CPU)")


def _activation_row(cfg, m: ModelConfig, b: int) -> BudgetRow:
    ckpt = cfg.optim.activation_checkpointing
    per_token = activation_bytes_per_token(m, b, ckpt)
    how = "checkpointed layer inputs + one layer" if ckpt else "upper bound, no checkpointing"
    return BudgetRow("training activations", "device", cfg.optim.micro_batch_tokens * per_token,
                     f"{cfg.optim.micro_batch_tokens} tokens x {per_token / 1024:.0f} KiB ({how})")


def _count(n: int) -> str:
    return f"{n / 2**20:.0f}Mi" if n >= 2**20 and n % 2**20 == 0 else f"{n / 1e6:.1f}M"


def fit_line(rows: list[BudgetRow], capacity: int) -> tuple[bool, str]:
    """(fits, one line): the device total (every row live at once, an upper bound) against ``capacity`` bytes."""
    need = totals(rows).get("device", 0)
    spare = capacity - need
    if spare >= 0:
        return True, f"fits the device: {_size(need)} of {_size(capacity)}, {_size(spare)} spare ({spare / capacity:.1%})"
    return False, (f"does NOT fit the device: {_size(need)} of {_size(capacity)}, {_size(-spare)} over; lower "
                   "rollout.kv_cache_bytes, optim.micro_batch_tokens or optim.step_chunk_elements, or set optim.offload=true")


def host_capacity() -> "int | None":
    """The machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def refuse_what_cannot_fit(cfg, model_dir: Path) -> None:
    """Before any weight is loaded: raise one line when the budget of ``cfg`` for the model in ``model_dir`` needs
    more than the GPU's total memory, or more than the host's physical memory (the host rows, plus the device rows
    when the model runs on the CPU). The budget takes every row as live at once (an upper bound), so
    ``run.check_memory=false`` starts a run the bound refuses. Not checked: tensor-parallel runs (the budget counts
    one process with the whole model) and other launchers or engines (their processes hold other parts)."""
    if not cfg.run.check_memory or cfg.parallel.tp is not None or cfg.launcher != "local" \
            or cfg.rollout.engine != "rlalign":
        return
    rows = memory_budget(cfg, ModelConfig.from_hf_dict(read_config_json(model_dir)[1]))
    need = totals(rows)
    on_cpu = not cfg.model.device.startswith("cuda")
    limits = [("the GPU", need.get("device", 0), None if on_cpu else device_capacity(cfg)),
              ("the host", need.get("host", 0) + (need.get("device", 0) if on_cpu else 0), host_capacity())]
    for place, bytes_needed, capacity in limits:
        if capacity is not None and bytes_needed > capacity:
            raise BudgetError(f"this run's memory budget needs {_size(bytes_needed)} on {place}, which has "
                              f"{_size(capacity)}: `python -m rlalign.train.budget CONFIG` prints the rows (lower "
                              "optim.micro_batch_tokens or rollout.kv_cache_bytes, or set optim.offload=true, "
                              "model.lora.rank or parallel.shard); run.check_memory=false starts it anyway")


def device_capacity(cfg) -> "int | None":
    """The model device's memory in bytes: a visible CUDA device's total, else None (pass --device-memory)."""
    if cfg.model.device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(cfg.model.device)).total_memory
    return None


def totals(rows: list[BudgetRow]) -> dict[str, int]:
    """Peak per place, taking every row as live at once (the checkpoint rows add at a save)."""
    out: dict[str, int] = {}
    for r in rows:
        out[r.place] = out.get(r.place, 0) + r.nbytes
    return out


def format_budget(rows: list[BudgetRow]) -> str:
    width = max(len(r.component) for r in rows)
    lines = [f"| {'component':<{width}} | place | size | notes |", f"|{'-' * (width + 2)}|---|---:|---|"]
    lines += [f"| {r.component:<{width}} | {r.place} | {_size(r.nbytes)} | {r.note} |" for r in rows]
    lines += [f"| **total, {place}** | {place} | **{_size(n)}** | |" for place, n in totals(rows).items()]
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlalign.train.budget", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--model-config", help="a config.json (default: model.path/config.json)")
    p.add_argument("--device-memory", type=float, metavar="GIB",
                   help="the device's usable memory in GiB, for the fit verdict (default: the visible CUDA "
                        "device's total; e.g. 139 for an H200); exit status 1 when the budget does not fit")
    args = p.parse_args(argv)
    try:
        cfg = resolve_train_config(args.config, args.overrides)
        path = Path(args.model_config or Path(cfg.model.path) / "config.json")
        if not path.is_file():
            raise RLAlignError(f"no model config at {path}: pass --model-config FILE (e.g. one written by "
                               "scripts/make_qwen3_8b.py --config-only)")
        model_config = ModelConfig.from_hf_dict(json.loads(path.read_text()))
        rows = memory_budget(cfg, model_config)
    except RLAlignError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_budget(rows))
    capacity = int(args.device_memory * 2**30) if args.device_memory else device_capacity(cfg)
    if capacity is None:
        return 0
    fits, line = fit_line(rows, capacity)
    print(line)
    return 0 if fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
