"""Building what a run needs from its config: the policy + tokenizer, and the task."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from rlalign import mklmode
from rlalign.contract.errors import RLAlignError
from rlalign.envs.loading import load_env
from rlalign.models.checkpoint import load_model, load_model_config
from rlalign.models.tokenizer import load_tokenizer
from rlalign.tasks import ArithmeticTask
from rlalign.tasks.arithmetic import Problem
from rlalign.tasks.datasets import Columns, StreamedRows, TrainRows, load_dataset, load_examples
from rlalign.tasks.reward_set import RewardSet
from rlalign.tasks.reward_terms import RewardTerm, parse_terms
from rlalign.train.config import ModelSection, TaskSection

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "default_model"


class SetupError(RLAlignError):
    pass


def resolve_model_dir(path: str) -> Path:
    if path == "default":
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            raise SetupError(f"the embedded default model is missing from {DEFAULT_MODEL_DIR}; "
                             "rebuild it with `rlalign pretrain` (see docs/default_model.md)")
        return DEFAULT_MODEL_DIR
    d = Path(path).expanduser()
    if not d.is_dir():
        raise SetupError(f"model.path {path!r} is not a directory (give a Hugging Face checkpoint dir, or 'default')")
    return d


def load_policy(section: ModelSection):
    """(model in train mode, tokenizer, model dir). Checks tokenizer and model agree on the vocab."""

    model_dir = resolve_model_dir(section.path)
    _pin_mkl(section.device)
    if section.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise SetupError("model.device is cuda but no CUDA device is visible; use model.device=cpu")
    _refuse_float16(model_dir, section.dtype)
    model, config = load_model(model_dir, dtype=section.dtype, device=section.device)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer.vocab_size > config.vocab_size:
        raise SetupError(f"tokenizer/model mismatch in {model_dir}: the tokenizer has {tokenizer.vocab_size} tokens "
                         f"but the model's vocab_size is {config.vocab_size}; use the tokenizer the model was trained with")
    if not tokenizer.eos_token_ids:
        raise SetupError(f"{model_dir}: no eos token (tokenizer_config.json eos_token or config.json eos_token_id); "
                         "completions could never stop")
    model.train()
    return model, tokenizer, model_dir


def _pin_mkl(device: str) -> None:
    """In the cross-machine mode (RLALIGN_CPU_CROSS_MACHINE=1), MKL's machine-independent branch for a CPU run
    (the CLI pinned it already; a library caller's process may not have called MKL yet); fail closed when MKL
    already runs another branch: the run's bits would then be this machine's only."""
    mklmode.pin()
    if mklmode.cross_machine() and not device.startswith("cuda"):
        pinned, detail = mklmode.status()
        if not pinned:
            raise SetupError(f"RLALIGN_CPU_CROSS_MACHINE=1 but {detail}")


def _refuse_float16(model_dir: Path, dtype: "str | None") -> None:
    """Training computes in float32 or bfloat16 (both profiles); a float16 checkpoint must pick one
    explicitly instead of training in float16 (strict refuses fp16 ops; native would overflow silently)."""
    if dtype is None and str(load_model_config(model_dir).dtype).removeprefix("torch.") in ("float16", "fp16", "half"):
        raise SetupError(f"{model_dir} is a float16 checkpoint; train it in model.dtype=bfloat16 or model.dtype=float32")


class TaskData:
    """Train stream (indexable by data position), held-out problems, encoding and checked scoring.

    ``rewards`` scores batches: ``rewards.score(prompts, completions, answers, extras, conversations)`` (a
    :class:`~rlalign.tasks.reward_set.RewardSet`, which :meth:`close` stops). A multi-turn task (``task.env``)
    has ``env``, a factory of one environment per episode (:func:`rlalign.envs.load_env`), and no rewards (None):
    the env's rewards score the episode."""

    def __init__(self, train_fn, eval_list: Sequence, rewards, tokenizer, chat: bool,
                 system_prompt: "str | None" = None, enable_thinking: "bool | None" = None, env=None):
        self.env = env
        self._train_fn = train_fn
        self._eval = [Problem(p.prompt, p.answer, p.extra) for p in eval_list]
        self.rewards = rewards
        self.tokenizer = tokenizer
        self.chat = chat
        self.system_prompt = system_prompt
        # passed to the chat template only when set (templates without the variable ignore it)
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}

    def train(self, start: int, count: int) -> list[Problem]:
        return [Problem(p.prompt, p.answer, p.extra) for p in (self._train_fn(i) for i in range(start, start + count))]

    def eval_problems(self) -> list[Problem]:
        return self._eval

    def messages(self, prompt) -> list[dict]:
        """A chat prompt's messages: a dataset's message list, or a string as one user message;
        ``task.system_prompt`` first unless the prompt brings its own system message."""
        msgs = list(prompt) if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt}]
        if self.system_prompt is not None and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": self.system_prompt}] + msgs
        return msgs

    def is_chat(self, prompt) -> bool:
        return self.chat or isinstance(prompt, (list, tuple))   # a message list can only mean chat

    def encode(self, prompt) -> list[int]:
        """The prompt's token ids; a character the tokenizer can only map to its unknown token is an
        error (it would silently become ``<unk>``/``<pad>`` and the task would be unlearnable)."""
        for text in ([m["content"] for m in self.messages(prompt)] if self.is_chat(prompt) else [prompt]):
            problem = self.tokenizer.encodability_problem(text)
            if problem:
                raise SetupError(problem)
        if self.is_chat(prompt):
            return self.tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True,
                                                      **self.template_kwargs)
        return self.tokenizer.encode(prompt)

    def prompt_text(self, prompt) -> str:
        """What the reward receives as the prompt: the text the model was given (chat prompts rendered)."""
        if self.is_chat(prompt):
            return self.tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True,
                                                      tokenize=False, **self.template_kwargs)
        return prompt

    def score(self, problems, completions) -> list[float]:
        """Each completion's reward against its problem (prompt as the model saw it, answer, the row's extra fields)."""
        return self.rewards.score([self.prompt_text(p.prompt) for p in problems], completions,
                                  [p.answer for p in problems], [p.extra for p in problems],
                                  [self.messages(p.prompt) if self.is_chat(p.prompt) else None for p in problems])

    def take_reward_terms(self) -> dict[str, float]:
        """Each weighted reward term's mean since the last call (``task.rewards`` with two terms or more), else {}."""
        take = getattr(self.rewards, "take_term_means", None)
        return take() if take is not None else {}

    def close(self) -> None:
        """Stop the reward worker (idempotent)."""
        close = getattr(self.rewards, "close", None)
        if close is not None:
            close()


def build_task(section: TaskSection, tokenizer, seed: int, device: str = "cpu") -> TaskData:
    """The task of ``section``, its rewards loaded (rlalign.tasks.reward_set: rule rewards in worker processes,
    reward models on ``device``): a reward that cannot be loaded fails here, before training; :meth:`TaskData.close`
    stops the workers. With ``task.env`` the env is loaded (and tried once) instead of the rewards."""
    env = load_env(section.env, section.env_args) if section.env is not None else None
    if section.name == "arithmetic":
        task = ArithmeticTask(seed=seed, min_digits=section.min_digits, max_digits=section.max_digits,
                              eval_size=section.eval_size)
        rewards = _rewards(section, "arithmetic", device) if env is None else None
        return TaskData(task.train_problem, task.eval_problems, rewards, tokenizer, section.chat,
                        section.system_prompt, section.enable_thinking, env)
    if section.reward == "builtin" and not section.rewards and env is None:
        raise SetupError("task.reward must name a reward for a dataset task (gsm8k, gsm8k_last_number, or module:function)")
    train_fn, held_out = _dataset(section, seed)
    if section.eval_size:
        held_out = held_out[:section.eval_size]
    rewards = _rewards(section, section.reward, device) if env is None else None
    return TaskData(train_fn, held_out, rewards, tokenizer, section.chat, section.system_prompt,
                    section.enable_thinking, env)


def _rewards(section: TaskSection, builtin: str, device: str) -> RewardSet:
    """``task.rewards``' terms, or ``task.reward`` alone (``builtin`` standing for the task's own reward)."""
    terms = parse_terms(section.rewards) if section.rewards else [RewardTerm(name=builtin if section.reward == "builtin"
                                                                             else section.reward)]
    return RewardSet(terms, timeout_s=section.reward_timeout_s, device=device)


def _dataset(section: TaskSection, seed: int):
    """(train position -> example, held-out examples) of a dataset task."""
    columns = Columns(section.columns.get("prompt", section.prompt_field),
                      section.columns.get("answer", section.answer_field),
                      {k: v for k, v in section.columns.items() if k not in ("prompt", "answer")})
    held_out = None
    if section.eval_path:
        held_out = load_examples(section.eval_path, columns=columns, prompt_template=section.template,
                                 split=section.eval_split)
    if section.streaming:
        stream = StreamedRows(section.path, columns=columns, template=section.template, split=section.split, seed=seed,
                              eval_fraction=0.0 if held_out is not None else section.eval_fraction,
                              shuffle=section.shuffle, shuffle_buffer=section.shuffle_buffer)
        return stream, held_out if held_out is not None else stream.eval_examples(section.eval_size)
    train, split_off = load_dataset(section.path, columns=columns, prompt_template=section.template, split=section.split,
                                    eval_fraction=0.0 if held_out is not None else section.eval_fraction, seed=seed)
    return TrainRows(train, seed, section.shuffle), held_out if held_out is not None else split_off
