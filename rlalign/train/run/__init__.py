"""A training run's directory and what the run says: the one owner of everything a run writes besides the policy.

- :mod:`~rlalign.train.run.directory`: the directory's lifecycle (lock, fresh run / resume, what may be deleted);
- :mod:`~rlalign.models.atomic`: files written whole (temp file, fsync, rename);
- :mod:`~rlalign.train.run.checkpoint_files`: checksummed checkpoint files and ``checkpoints/latest.json``;
- :mod:`~rlalign.train.run.metrics`: ``metrics.jsonl``;
- :mod:`~rlalign.train.run.config_file`: ``config.yaml`` and the resume rules for config and reward code;
- :mod:`~rlalign.train.run.logs`: the start banner, the step lines and the progress bar;
- :mod:`~rlalign.train.run.trackers`: TensorBoard and W&B (``run.loggers``);
- :mod:`~rlalign.train.run.report`: ``rlalign report`` (plots and a summary of metrics.jsonl).

What a checkpoint holds (the trainer's state) is :mod:`rlalign.train.checkpointing`'s.
"""
