"""CPU proxy of a GRPO run's learning dynamics, for choosing a reward and learning rate (not a trainer).

    python bench/grpo_lr_proxy.py DIR --lr 1e-3 --steps 150 --new 8 --reward match_then_stop \
        --extra-char-cost 0.0244 --out proxy.jsonl
    python bench/grpo_lr_proxy.py DIR --first-token-values 400    # positional_match's prompt-blind ceiling

Why it exists: the strict CPU path scores the full 151,936-id vocabulary through tiled kernels (step 0's
eval of the 8B config on a toy body did not finish in 5 minutes on the 2-core machine), too slow for
the hundreds of steps an lr study needs. This loop runs the same arithmetic in eager torch:
rollouts of ``--prompts`` arithmetic problems x ``--samples`` (temperature ``--temp``, no top-p), the
reward from configs/partial_credit.py, GRPO advantages (rlalign.algos.advantages.grpo_advantages), one
optimizer step per rollout on loss = -sum(A * log p(token)) / (completion tokens) (ppo_clip's value at
ratio 1: one epoch, one mini-batch), AdamW (betas 0.9/0.99, no weight decay), grad-norm clip 1.0,
linear warm-up then cosine down to 0.1 x lr over ``--schedule-steps``. Not bit-exact with the trainer
and without KV cache (each decode step recomputes the prefix).

Each step prints one JSON line: reward, entropy and p(<eos>) averaged over the completion positions,
completion length in tokens and characters, and ``gain_pos`` / ``gain_neg``: how far the log-probs of
step 1's sampled tokens with advantage > 0.5 / < -0.5 have moved since (nats, in their own contexts),
the per-event update size that decides whether any token can gain mass over a large vocabulary.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

import torch

from rlalign.algos.advantages import grpo_advantages
from rlalign.models.batch import ForwardBatch
from rlalign.models.checkpoint import load_model
from rlalign.tasks.arithmetic import ArithmeticTask

PARTIAL_CREDIT = Path(__file__).resolve().parents[1] / "configs" / "partial_credit.py"
EOS, ROW_CHUNK = 2, 1024


def token_texts(vocab_size: int) -> list[str]:
    """Decoded text of each id under scripts/make_qwen3_8b.py's tokenizer: specials empty (decode skips
    them), ids 3..14 the default model's characters, id 15 + i the number 10 + i."""
    return [""] * 3 + list("0123456789+=") + [str(10 + i) for i in range(vocab_size - 15)]


def first_token_values(vocab_size: int, answers: list[str]) -> list[float]:
    """positional_match's mean over ``answers`` for a completion that starts with each id's text and goes
    on with uniform random digits (a place past the first token matches with probability 1/10); the
    completion is longer than the answer (the -0.1 applies): what a prompt-blind policy can earn per id."""
    values = []
    for text in token_texts(vocab_size):
        if not text:   # <eos>: the empty completion scores 0 (<pad>, <bos>, also empty, are counted alike)
            values.append(0.0)
            continue
        total = 0.0
        for answer in answers:
            matched = sum(a == b for a, b in zip(text, answer)) + 0.1 * max(0, len(answer) - len(text))
            total += matched / len(answer) - 0.1
        values.append(total / len(answers))
    return values


def lr_at(step: int, args) -> float:
    if step <= args.warmup:
        return args.lr * step / max(args.warmup, 1)
    progress = min((step - args.warmup) / max(args.schedule_steps - args.warmup, 1), 1.0)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def rollout(model, prompts: list[list[int]], args) -> list[list[int]]:
    seqs, done = [list(p) for p in prompts], [False] * len(prompts)
    for _ in range(args.new):
        live = [i for i, d in enumerate(done) if not d]
        if not live:
            break
        hidden = model.forward_hidden(ForwardBatch.packed([seqs[i] for i in live]))
        last = torch.tensor([len(seqs[i]) for i in live]).cumsum(0) - 1
        probs = torch.softmax(hidden[last] @ model.lm_head_weight.T / args.temp, -1)
        for i, token in zip(live, torch.multinomial(probs, 1).squeeze(-1).tolist()):
            seqs[i].append(token)
            done[i] = token == EOS and not args.ignore_eos
    return seqs


def completion_rows(seqs, prompt_lens):
    """(rows of the packed batch whose hidden state predicts a completion token, the tokens, sequence ids)."""
    rows, targets, owner, offset = [], [], [], 0
    for i, (seq, plen) in enumerate(zip(seqs, prompt_lens)):
        for pos in range(plen - 1, len(seq) - 1):
            rows.append(offset + pos)
            targets.append(seq[pos + 1])
            owner.append(i)
        offset += len(seq)
    return torch.tensor(rows), torch.tensor(targets), torch.tensor(owner)


def token_logprobs(model, seqs, rows, targets, temp):
    with torch.no_grad():
        hidden = model.forward_hidden(ForwardBatch.packed(seqs))[rows]
        return torch.log_softmax(hidden @ model.lm_head_weight.T / temp, -1).gather(1, targets[:, None]).squeeze(1)


def train_step(model, seqs, rows, targets, token_adv, temp) -> tuple[float, float]:
    """Accumulate the gradient of -sum(A log p) / n over row chunks; returns (mean entropy, mean p(<eos>))."""
    hidden = model.forward_hidden(ForwardBatch.packed(seqs))[rows]
    n, entropy, p_eos = len(rows), 0.0, 0.0
    for start in range(0, n, ROW_CHUNK):
        part = slice(start, start + ROW_CHUNK)
        logp = torch.log_softmax(hidden[part] @ model.lm_head_weight.T / temp, -1)
        with torch.no_grad():
            entropy += float(-(logp.exp() * logp).sum())
            p_eos += float(logp[:, EOS].exp().sum())
        loss = -(token_adv[part] * logp.gather(1, targets[part, None]).squeeze(1)).sum() / n
        loss.backward(retain_graph=start + ROW_CHUNK < n)
    return entropy / n, p_eos / n


def report_first_token_values(model_dir: str, n: int) -> int:
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    answers = [pr.answer for pr in ArithmeticTask(min_digits=2, max_digits=4).train_problems(0, n)]
    values = torch.tensor(first_token_values(vocab_size, answers), dtype=torch.float64)
    print(json.dumps(dict(answers=n, uniform_policy=float(values.mean()), spread=float(values.std()),
                          best=float(values.max()), best_token=token_texts(vocab_size)[int(values.argmax())])))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--lr", type=float)
    p.add_argument("--first-token-values", type=int, metavar="N",
                   help="instead of training: positional_match's prompt-blind value per first token over N train answers")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--schedule-steps", type=int, default=200, help="the cosine schedule's length (run.steps)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new", type=int, default=64, help="max new tokens")
    p.add_argument("--temp", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true", help="sample past <eos> (rollout.ignore_eos): fixed-length completions")
    p.add_argument("--reward", default="positional_match", help="a function of configs/partial_credit.py")
    p.add_argument("--extra-char-cost", type=float, help="override partial_credit.EXTRA_CHAR_COST (shorter proxies)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON lines here")
    args = p.parse_args(argv)
    if args.first_token_values:
        return report_first_token_values(args.model, args.first_token_values)
    if args.lr is None:
        p.error("--lr is needed to train")
    torch.manual_seed(args.seed)
    spec = importlib.util.spec_from_file_location("partial_credit", PARTIAL_CREDIT)
    credit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(credit)
    if args.extra_char_cost is not None:
        credit.EXTRA_CHAR_COST = args.extra_char_cost
    reward_fn = getattr(credit, args.reward)
    model, cfg = load_model(args.model, dtype=torch.float32)
    texts = token_texts(cfg.vocab_size)
    char_ids = {c: i for i, c in enumerate(texts[:15]) if c}
    task = ArithmeticTask(min_digits=2, max_digits=4)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    out = open(args.out, "w") if args.out else None
    tracked = None
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        problems = [pr for pr in task.train_problems((step - 1) * args.prompts, args.prompts) for _ in range(args.samples)]
        prompts = [[char_ids[c] for c in pr.prompt] for pr in problems]
        seqs = rollout(model, prompts, args)
        completions = ["".join(texts[t] for t in s[len(pr):]) for s, pr in zip(seqs, prompts)]
        rewards = torch.tensor([reward_fn(pr.prompt, c, pr.answer) for pr, c in zip(problems, completions)])
        groups = torch.arange(len(seqs)) // args.samples
        adv = grpo_advantages(rewards, groups, num_groups=args.prompts)
        rows, targets, owner = completion_rows(seqs, [len(pr) for pr in prompts])
        if tracked is None:   # step 1's tokens, whose log-probs gain_pos / gain_neg follow
            tracked = (seqs, rows, targets, adv[owner], token_logprobs(model, seqs, rows, targets, args.temp))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        opt.zero_grad()
        entropy, p_eos = train_step(model, seqs, rows, targets, adv[owner], args.temp)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        moved = token_logprobs(model, *tracked[:3], args.temp) - tracked[4]
        record = dict(step=step, lr=lr_at(step, args), reward=float(rewards.mean()), reward_std=float(rewards.std()),
                      entropy=entropy, p_eos=p_eos, grad_norm=grad_norm,
                      mean_len=sum(len(s) - len(pr) for s, pr in zip(seqs, prompts)) / len(seqs),
                      chars=sum(map(len, completions)) / len(completions),
                      gain_pos=float(moved[tracked[3] > 0.5].mean()), gain_neg=float(moved[tracked[3] < -0.5].mean()),
                      first=completions[0][:8], seconds=round(time.perf_counter() - started, 1))
        print(json.dumps(record), flush=True)
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
