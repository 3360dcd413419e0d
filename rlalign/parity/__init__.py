"""Parity tooling: capture, compare, replay and localize differences between a rollout engine and a trainer.

    capture   tap(name, t), note_batch(batch), note_rows(token_lists), capture(names, positions=, model=)
    compare   compare_captures(a, b) -> identical | localized (first op/layer/token/feature) | not comparable;
              compare_logprobs(rollout, train, tokens, prompt_lens)
    replay    RolloutRecord.save / RolloutRecord.load (JSONL), ReplayError
    sides     RLAlignRollout, RLAlignTrainer, TransformersTrainer
    run       run_parity(ParityOptions) -> ParityResult (``rlalign parity``), replay(record, trainer), localize(...)
    report    write_report(result, dir): parity.json, parity.md, logprob_diff_hist.png

Import the modules directly (``from rlalign.parity.capture import capture``); this package imports nothing.
Models never import parity: they call the tap hook of :mod:`rlalign.models.taps`, into which a
capture installs itself while active.
"""
