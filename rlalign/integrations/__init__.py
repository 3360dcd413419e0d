"""Integrations with other engines, the top layer under the CLI.

    transformers         Hugging Face models on rlalign ops (the patch); transformers_parity: the ``--train
                         transformers`` side of ``rlalign parity``
    vllm                 vLLM as a rollout engine (the plugin; ``rollout.engine=vllm``, ``--rollout vllm``)
    ray                  the Ray launcher (``launcher=ray``)

Importing this package fills the registries of the layers below (nothing below imports it): the rollout
engines of :mod:`rlalign.train.engines` and the parity sides of :mod:`rlalign.parity.sides`. None of it
imports vllm, ray or transformers until they are used.
"""

from rlalign.integrations import ray, transformers_parity, vllm

__all__ = ["ray", "transformers_parity", "vllm"]
