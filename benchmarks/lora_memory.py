"""Benchmark: the training state of one optimizer step, full fine-tuning vs LoRA (CPU; tensor bytes, exact).

A randomly initialised decoder of a Qwen3 shape (default: Qwen3-0.6B's widths and vocabulary, ``--layers`` of
its layers, bf16), trained as rlalign's trainer does (``MasterWeights`` fp32 masters + ``torch.optim.AdamW``,
``foreach=False``): one forward/backward of the fused log-prob loss on ``--tokens`` tokens, one optimizer step.
Counted after the step from the tensors themselves (bytes of distinct storages, so nothing is counted twice):
the model's parameters, the gradients the backward left (before the step frees them), the fp32 masters and
AdamW's ``exp_avg`` / ``exp_avg_sq``. With ``model.lora`` the base weights are frozen: no gradient, no master,
no optimizer state; only the adapters (rank ``--rank`` on q/k/v/o and gate/up/down) carry them.

    python benchmarks/lora_memory.py [--layers 2] [--rank 16] [--tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

from rlalign.models.batch import ForwardBatch
from rlalign.models.config import ModelConfig
from rlalign.models.decoder import CausalLM
from rlalign.models.lora import TARGETS, LoRASpec, apply_lora
from rlalign.train.master import MasterWeights

QWEN3_06B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                 intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
                 hidden_act="silu", torch_dtype="bfloat16")


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def measure(layers: int, rank: int | None, tokens: int) -> dict:
    config = ModelConfig.from_hf_dict(dict(QWEN3_06B, num_hidden_layers=layers))
    model = CausalLM(config, dtype=torch.bfloat16).init_random_(seed=0)
    if rank is not None:
        apply_lora(model, LoRASpec(rank=rank, alpha=2.0 * rank, targets=TARGETS), seed=0)
    model.train()
    master = MasterWeights(model)
    optimizer = torch.optim.AdamW(master.optim_params(), lr=1e-5, foreach=False)
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    lp, _ = model.logprobs(ForwardBatch.packed([ids], "cpu"), torch.tensor(ids[1:] + [0]))
    (-lp.sum()).backward()
    grads = _bytes(p.grad for p in model.parameters())
    master.step(optimizer)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    out = {"trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "parameters_bytes": _bytes(model.parameters()), "gradient_bytes": grads,
           "master_bytes": _bytes(m for m in master.masters), "adamw_state_bytes": _bytes(state)}
    out["training_state_bytes"] = sum(out[k] for k in ("gradient_bytes", "master_bytes", "adamw_state_bytes"))
    out["total_bytes"] = out["training_state_bytes"] + out["parameters_bytes"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    full, lora = measure(args.layers, None, args.tokens), measure(args.layers, args.rank, args.tokens)
    result = {"shape": f"Qwen3-0.6B widths x {args.layers} layers, bf16", "rank": args.rank, "full": full,
              "lora": lora, "training_state_ratio": lora["training_state_bytes"] / full["training_state_bytes"],
              "total_ratio": lora["total_bytes"] / full["total_bytes"]}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    mib = 2 ** 20
    print(f"{result['shape']}, LoRA rank {args.rank} on {', '.join(TARGETS)}")
    for key in ("trainable_parameters", "parameters_bytes", "gradient_bytes", "master_bytes", "adamw_state_bytes",
                "training_state_bytes", "total_bytes"):
        f, l_ = full[key], lora[key]
        unit = (lambda v: f"{v:,}") if key == "trainable_parameters" else (lambda v: f"{v / mib:,.1f} MiB")
        print(f"  {key:<22} full {unit(f):>16}   lora {unit(l_):>14}")
    print(f"  training state (grads + masters + AdamW): lora / full = {result['training_state_ratio']:.4f}; "
          f"with the weights: {result['total_ratio']:.3f}")


if __name__ == "__main__":
    main()
