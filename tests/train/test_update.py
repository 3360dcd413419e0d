"""The learning rate over a run and across a resume (rlalign.train.update.LearningRate)."""

from types import SimpleNamespace

import pytest
import torch

from rlalign.train.update import LearningRate, lr_factor

TOTAL = 10


def _schedule(lr: float, steps: int) -> tuple[torch.optim.Optimizer, LearningRate]:
    optim = SimpleNamespace(lr=lr, warmup_steps=3, min_lr_ratio=0.1)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr, foreach=False)
    schedule = LearningRate(optimizer, optim, TOTAL)
    for _ in range(steps):
        optimizer.step()
        schedule.step()
    return optimizer, schedule


def test_warmup_then_cosine_to_the_floor():
    optim = SimpleNamespace(warmup_steps=3, min_lr_ratio=0.1)
    assert [lr_factor(optim, TOTAL, s) for s in range(3)] == [1 / 3, 2 / 3, 1.0]
    assert lr_factor(optim, TOTAL, 3) == 1.0 and lr_factor(optim, TOTAL, TOTAL) == pytest.approx(0.1)
    _, schedule = _schedule(0.5, 4)
    assert schedule.current == 0.5 * lr_factor(optim, TOTAL, 4)


@pytest.mark.parametrize("new_lr", [0.5, 0.25], ids=["same-lr", "lr-overridden"])
def test_a_resumed_schedule_continues_as_a_run_started_at_the_configs_lr(new_lr):
    """A checkpoint's schedule loaded under this config's optim.lr: the next step uses the config's lr at the
    checkpoint's step, and one step later the schedule's state is that of a run that had that lr throughout."""
    _, saved = _schedule(0.5, 4)
    optimizer, resumed = _schedule(new_lr, 0)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.current == new_lr * resumed.factor(4)
    assert optimizer.param_groups[0]["initial_lr"] == new_lr
    optimizer.step()
    resumed.step()
    _, throughout = _schedule(new_lr, 5)
    assert resumed.state_dict() == throughout.state_dict()
    assert resumed.current == throughout.current
