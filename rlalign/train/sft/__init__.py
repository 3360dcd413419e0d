"""Supervised fine-tuning (``rlalign sft``): the response-only loss on packed sequences with the trainer's model
code, strict ops, optimizer and run directory. Rooms: ``loop`` (the run), ``state`` (checkpoints and resume),
``update`` (one optimizer step, the held-out loss, the order of the examples), ``data`` (JSONL rows to examples),
``objective`` (examples, their packed forward and the loss), ``config``."""
