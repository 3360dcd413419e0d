"""Reward models: a Hugging Face *ForSequenceClassification checkpoint scored on rlalign's decoder in the strict
profile. A sample's score has the same bits whatever else shares its batch (composition, order, micro-batch
budget, trailing pad tokens); it agrees with transformers' own forward on the same checkpoint; the reward model's
own tokenizer and chat template render what it scores; bad checkpoints are refused in one line."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from rlalign.contract.bits import bits_equal, describe_difference
from rlalign.models.checkpoint import CheckpointError
from rlalign.models.scorer import score_index
from rlalign.models.testing import make_tiny_reward_model
from rlalign.tasks import RewardLoadError
from rlalign.tasks.reward_model import RewardModel, micro_batches

FAMILIES = ("llama", "qwen2", "qwen3")
PAD = 0


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rms")
    return {f: make_tiny_reward_model(root / f, f, seed=3) for f in FAMILIES}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def qwen3_rm(rm_dirs, request):
    return RewardModel(rm_dirs["qwen3"], dtype=request.param, micro_batch_tokens=64)


token_lists = st.lists(st.lists(st.integers(1, 319), min_size=1, max_size=24), min_size=1, max_size=6)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seqs=token_lists, budget=st.integers(1, 80), pads=st.lists(st.integers(0, 3), min_size=6, max_size=6),
       order=st.randoms(use_true_random=False))
def test_a_samples_score_does_not_depend_on_its_batch(qwen3_rm, seqs, budget, pads, order):
    alone = torch.tensor([qwen3_rm.score_tokens([s])[0] for s in seqs])
    perm = list(range(len(seqs)))
    order.shuffle(perm)
    padded = [seqs[i] + [PAD] * pads[j] for j, i in enumerate(perm)]   # right padding, as in a padded batch
    qwen3_rm.micro_batch_tokens = budget
    try:
        together = torch.tensor(qwen3_rm.score_tokens(padded))
    finally:
        qwen3_rm.micro_batch_tokens = 64
    back = torch.empty_like(together)
    back[torch.tensor(perm)] = together
    assert bits_equal(alone, back), describe_difference(alone, back)


@pytest.mark.parametrize("family", FAMILIES)
def test_agrees_with_transformers_sequence_classification(rm_dirs, family):
    transformers = pytest.importorskip("transformers")
    directory = rm_dirs[family]
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    assert type(ref).__name__.endswith("ForSequenceClassification")
    seqs = [[5, 9, 17, 33, 2], [40, 41], [7, 8, 9, PAD, 11, PAD], [PAD, PAD], [12]]   # pad tokens inside and at the end
    width = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits[:, 0]
    got = torch.tensor(RewardModel(directory).score_tokens(seqs))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@given(st.lists(st.integers(0, 3), max_size=12), st.sampled_from([None, 0, 3]))
def test_score_index_is_transformers_rightmost_non_pad(tokens, pad):
    tokens = tokens or [1]
    t = torch.tensor([tokens])
    expected = len(tokens) - 1 if pad is None else int((torch.arange(len(tokens)) * (t != pad).int()).argmax(-1))
    assert score_index(tokens, pad) == expected


@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 60))
def test_micro_batches_keep_order_and_budget(lengths, budget):
    groups = micro_batches(lengths, budget)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    assert all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in groups)


def test_the_reward_models_own_chat_template_renders_what_it_scores(rm_dirs, tmp_path):
    rm = RewardModel(rm_dirs["qwen3"])
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    expected = rm.tokenizer.apply_chat_template([*conv, {"role": "assistant", "content": "4"}],
                                                add_generation_prompt=False)
    assert rm.encode(conv, "ignored policy text", "4") == expected
    assert rm.score(["p"], ["4"], [conv]) == rm.score_tokens([expected])
    config = json.loads((rm_dirs["qwen3"] / "tokenizer_config.json").read_text())
    plain = tmp_path / "plain"
    make_tiny_reward_model(plain, "qwen3", seed=3)
    (plain / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    no_template = RewardModel(plain)   # no chat template: the policy's prompt text + the completion, plain
    assert no_template.encode(conv, "Q: 2+2? A:", " 4") == no_template.tokenizer.encode("Q: 2+2? A: 4")


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForSequenceClassification"]}, "is not a supported reward model"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "is not a supported reward model"),
    ({"id2label": {"0": "a", "1": "b"}}, "num_labels=2; a reward model has one score"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"torch_dtype": "float16"}, "is a float16 checkpoint, which the strict ops do not run; give the entry dtype"),
])
def test_bad_reward_models_are_one_line(rm_dirs, tmp_path, change, message):
    bad = make_tiny_reward_model(tmp_path / "bad", "qwen3")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises((CheckpointError, RewardLoadError), match=message) as err:
        RewardModel(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(RewardLoadError, match="not a directory"):
        RewardModel(tmp_path / "missing")
