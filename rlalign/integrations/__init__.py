"""Integrations with other engines: ``rlalign.integrations.transformers`` (Hugging Face models on rlalign ops)."""
