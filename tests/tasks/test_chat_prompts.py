"""Chat-format prompts: message lists in datasets, the tokenizer's template, system prompt, enable_thinking."""

import json

import pytest

from rlalign.models.testing import write_tiny_tokenizer
from rlalign.tasks import score
from rlalign.models.tokenizer import load_tokenizer
from rlalign.tasks.datasets import DatasetError, load_examples
from rlalign.train.config import TaskSection
from rlalign.train.setup import build_task

THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")


@pytest.fixture
def tokenizer(tmp_path):
    (tmp_path / "tok").mkdir()
    write_tiny_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    tok.chat_template = THINKING_TEMPLATE
    return tok


class InProcess:
    """A reward scored in this process (so the test sees what it was called with)."""

    def __init__(self, fn):
        self.fn = fn

    def score(self, prompts, completions, answers, extras, conversations=None):
        return score(self.fn, prompts, completions, answers, extras)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_message_prompts_system_prompt_and_thinking(tokenizer, tmp_path):
    data = _write(tmp_path / "d.jsonl", [
        {"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"},
        {"prompt": [{"role": "system", "content": "Own system."}, {"role": "user", "content": "2+2?"}], "answer": "4"},
        {"prompt": "3+3?", "answer": "6"}])
    section = TaskSection(name="dataset", path=str(data), reward="gsm8k", eval_fraction=0.0,
                          system_prompt="Be brief.", enable_thinking=False)
    task = build_task(section, tokenizer, seed=0)
    first, own, plain = task.train(0, 3)
    text = task.prompt_text(first.prompt)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert task.encode(first.prompt) == tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert "Be brief." not in task.prompt_text(own.prompt) and "Own system." in task.prompt_text(own.prompt)
    assert task.prompt_text(plain.prompt) == "3+3?"   # task.chat=false: string prompts stay plain text
    seen = []
    task.close()
    task.rewards = InProcess(lambda p, c, a: seen.append(p) or 1.0)
    task.score([first], ["2"])
    assert seen == [text], "the reward gets the prompt as the model saw it"


def test_string_prompts_under_chat_match_the_tokenizer_chat_encoding(tokenizer, tmp_path):
    data = _write(tmp_path / "d.jsonl", [{"prompt": "5+5?", "answer": "10"}])
    task = build_task(TaskSection(name="dataset", path=str(data), reward="gsm8k", eval_fraction=0.0, chat=True),
                      tokenizer, seed=0)
    assert task.encode("5+5?") == tokenizer.encode("5+5?", chat=True)
    task.close()


@pytest.mark.parametrize("prompt, message", [
    ([{"role": "user"}], "message 0 must be"),
    ([{"role": "robot", "content": "x"}], "message 0 must be"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "must end with a user message"),
    ([], "must end with a user message"),
    (7, "must be a string or a list of chat messages"),
])
def test_bad_message_rows_name_the_row(tmp_path, prompt, message):
    data = _write(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": prompt, "answer": "1"}])
    with pytest.raises(DatasetError, match=f"d.jsonl:2: .*{message}"):
        load_examples(data)


def test_template_with_message_prompts_is_refused(tmp_path):
    data = _write(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}])
    with pytest.raises(DatasetError, match="prompt_template applies to string prompts only"):
        load_examples(data, prompt_template="Q: {prompt}")


def test_a_rows_other_fields_reach_the_reward(tokenizer, tmp_path):
    data = _write(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2", "level": "easy", "tags": ["add"]}])
    task = build_task(TaskSection(name="dataset", path=str(data), reward="gsm8k", eval_fraction=0.0), tokenizer, seed=0)
    row, = task.train(0, 1)
    assert row.extra == {"level": "easy", "tags": ["add"]}
    seen = []
    task.close()
    task.rewards = InProcess(lambda p, c, a, level=None, **rest: seen.append((level, rest)) or 1.0)
    assert task.score([row], ["2"]) == [1.0]
    assert seen == [("easy", {"tags": ["add"]})]
