"""The decoder (Llama / Qwen2 / Qwen3 families) on ``rlalign.ops``, and HF checkpoints in and out.

    architectures  the architecture registry: family -> ModelConfig feature fields (and back)
    config      ModelConfig.from_hf_dict / to_hf_dict (unsupported features raise ModelConfigError)
    blocks      functional per-block cores (attention, FFN, layer), shared with the transformers patch
    modules     Linear / RMSNorm / Embedding;  ffn: FFN kinds (registry); modules declare TP plans
                (``tp_plan``, vocabulary in rlalign.contract.sharding)
    taps        boundary names and the tap hook a recorder (parity's capture) is installed into
    batch       ForwardBatch (packed | prefill | decode | extend), KVCache
    decoder     CausalLM: forward_hidden, logprobs, logits
    checkpoint  load_model, save_model, load_tokenizer, weights_hash, CheckpointError
    generate    generate (simple prefill + decode loop), Completion
    testing     make_tiny_checkpoint, tiny_model (import rlalign.models.testing)
"""

from rlalign.models.batch import ForwardBatch, KVCache, contiguous_block_tables, next_token_targets
from rlalign.models.checkpoint import (CheckpointError, load_model, load_model_config, load_tokenizer, save_model,
                                       weights_hash)
from rlalign.models.config import ModelConfig, ModelConfigError
from rlalign.models.decoder import CausalLM
from rlalign.models.completion import Completion
from rlalign.models.generate import generate
from rlalign.models.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "ForwardBatch", "KVCache", "contiguous_block_tables", "next_token_targets",
    "CheckpointError", "load_model_config", "load_model", "load_tokenizer", "save_model", "weights_hash",
    "ModelConfig", "ModelConfigError", "CausalLM", "Completion", "generate", "Tokenizer", "TokenizerError",
]
