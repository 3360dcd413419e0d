"""The algorithm registries: every declared knob changes what its algorithm computes; a key the chosen
algorithm does not read is refused (one line naming the key, the algorithm and who reads it)."""

import dataclasses

import pytest
import torch

from rlalign import algos
from rlalign.algos.registry import REGISTRIES, REQUIRES
from rlalign.configlib import ConfigError, load_config
from rlalign.train.config import AlgoSection, TrainConfig

D = torch.float64
# a value other than the default for every knob (a knob added without one here fails the test below)
OTHER = {"clip_low": 0.05, "clip_high": 0.9, "dual_clip": 1.5, "gamma": 0.5, "lam": 0.5, "mismatch_cap": 1.1,
         "turn_advantage": "turn", "vtrace_rho_cap": 0.5, "vtrace_c_cap": 0.5}
# what a key needs besides its algorithm to be accepted (turn_advantage=turn: multi-turn episodes)
NEEDS = {"turn_advantage": ["task.env=retry_arithmetic"]}


def _token_inputs():
    """6 sequences x 3 tokens, ratios from exp(-2) to exp(2), advantages of both signs."""
    seq_ids = torch.arange(6).repeat_interleave(3)
    log_ratio = torch.linspace(-2.0, 2.0, 18, dtype=D)
    lp = (torch.full((18,), -1.0, dtype=D) + log_ratio).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5, 0.7, -1.3], dtype=D)[seq_ids]
    return lp, torch.full((18,), -1.0, dtype=D), adv, torch.ones(18, dtype=torch.bool), seq_ids


def _policy_loss(entry, knobs):
    lp, old, adv, mask, seq_ids = _token_inputs()
    # gspo's ratio is per sequence: give the sequences different mean log-ratios around 0
    out = entry.fn(lp, old, adv, mask, seq_ids, 6, None, **knobs)
    out.loss.sum().backward()
    return torch.cat([out.loss.detach(), lp.grad])


def _advantage(entry, knobs):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.3])
    seq_ids = torch.arange(6).repeat_interleave(3)
    # multi-turn episodes: sequence 0 takes 2 turns, sequence 3 takes 3 (turn 0's return-to-go is the reward)
    turns = algos.TurnInputs(torch.tensor([1.0, 0.4, 0.0, 0.5, 0.2, 0.1, 0.6, 0.9, 0.3]),
                             torch.tensor([2, 1, 1, 3, 1, 1]),
                             torch.tensor([0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0]))
    inputs = algos.AdvantageInputs(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), seq_ids, torch.ones(18, dtype=torch.bool),
                                   values=torch.linspace(-0.5, 0.5, 18), turns=turns,
                                   log_ratio=torch.linspace(-1.0, 1.0, 18))   # gae: an older policy's samples
    adv, returns = entry.fn(inputs, **knobs)
    return adv if returns is None else torch.cat([adv, returns])


def _correction(entry, knobs):
    _, old, _, mask, seq_ids = _token_inputs()
    rollout = old - torch.linspace(-0.5, 0.5, 18, dtype=D)
    corr = entry.fn(old, rollout, mask, seq_ids, **knobs)
    return torch.cat([corr.weights.double(), corr.mask.double()])


COMPUTE = {"policy_loss": _policy_loss, "advantage": _advantage, "mismatch_correction": _correction}
KNOBS = [(r.key, name, knob) for r in REGISTRIES for name in r.names() for knob in r[name].knobs]


@pytest.mark.parametrize("key, name, knob", KNOBS, ids=[f"{k}={n}:{kn}" for k, n, kn in KNOBS])
def test_each_knob_changes_what_its_algorithm_computes(key, name, knob):
    entry = algos.registry.REGISTRIES[[r.key for r in REGISTRIES].index(key)][name]
    defaults = entry.knob_values({})
    assert OTHER[knob] != defaults[knob]
    base = COMPUTE[key](entry, defaults)
    changed = COMPUTE[key](entry, {**defaults, knob: OTHER[knob]})
    assert not torch.equal(base, changed), f"{key}={name}: setting {knob} changed nothing"


def test_value_clip_changes_the_value_loss():
    v = torch.linspace(0.0, 1.0, 8, dtype=D)      # moving from the old values (0) towards the returns (1)
    old, ret = torch.zeros(8, dtype=D), torch.ones(8, dtype=D)
    assert not torch.equal(algos.value_loss(v, old, ret, 0.2), algos.value_loss(v, old, ret, None))
    assert not torch.equal(algos.value_loss(v, old, ret, 0.2), algos.value_loss(v, old, ret, 0.5))


def test_unset_knobs_take_the_algorithm_s_own_defaults():
    """The bug this registry fixed: algo.clip_low / clip_high reached only ppo_clip."""
    settings = dataclasses.asdict(AlgoSection())
    assert algos.POLICY_LOSSES["gspo"].knob_values(settings) == {"clip_low": 3e-4, "clip_high": 4e-4}
    assert algos.POLICY_LOSSES["ppo_clip"].knob_values(settings) == {"clip_low": 0.2, "clip_high": 0.28,
                                                                     "dual_clip": None}
    settings.update(clip_low=0.1, clip_high=0.5)
    for name in algos.POLICY_LOSSES.names():
        values = algos.POLICY_LOSSES[name].knob_values(settings)
        assert (values["clip_low"], values["clip_high"]) == (0.1, 0.5), name


def _refusals():
    """(chooser overrides, key, value) for every key some entry reads but the chosen entry does not."""
    cases = []
    for registry in REGISTRIES:
        for name in registry.names():
            for key in sorted(registry.all_keys() - registry[name].keys):
                value = OTHER.get(key, {"value_lr": 0.5, "value_clip": None}.get(key))
                cases.append(([f"algo.{registry.key}={name}"], key, value))
    cases += [([], "kl_estimator", "k1"), ([], "kl_in_reward", True), ([], "max_draw_rounds", 5)]
    return cases


REFUSALS = _refusals()


@pytest.mark.parametrize("chooser, key, value", REFUSALS, ids=[f"{c[0] if c else ''}:{k}" for c, k, _ in REFUSALS])
def test_a_key_that_does_not_apply_is_refused_in_one_line(chooser, key, value):
    override = f"algo.{key}={'null' if value is None else str(value).lower()}"
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, None, chooser + [override])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"algo.{key}=") and "has no effect" in msg, msg
    if chooser:
        assert chooser[0] in msg, msg


@pytest.mark.parametrize("chooser, key, value", REFUSALS, ids=[f"{c[0] if c else ''}:{k}" for c, k, _ in REFUSALS])
def test_the_same_key_is_accepted_where_it_applies_and_at_its_default(chooser, key, value):
    default = {f.name: f.default for f in dataclasses.fields(AlgoSection)}[key]
    load_config(TrainConfig, None, chooser + [f"algo.{key}={'null' if default is None else str(default).lower()}"])
    readers = [r for r in REGISTRIES if key in r.all_keys()]
    enable = ([f"algo.{readers[0].key}={readers[0].readers_of(key)[0]}"] if readers else
              {"kl_estimator": ["algo.kl_coef=0.1"], "kl_in_reward": ["algo.kl_coef=0.1"],
               "max_draw_rounds": ["algo.dynamic_sampling=true"]}[key]) + NEEDS.get(key, [])
    override = f"algo.{key}={'null' if value is None else str(value).lower()}"
    load_config(TrainConfig, None, enable + [override])


def test_every_conditional_key_is_tested():
    assert {k for c, k, _ in REFUSALS if not c} == set(REQUIRES)


def test_config_choices_are_the_registry_names():
    import typing
    hints = typing.get_type_hints(AlgoSection)
    for registry in REGISTRIES:
        assert typing.get_args(hints[registry.key]) == registry.names()
