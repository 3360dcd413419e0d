"""CPU proxy of a GRPO run's learning dynamics, for choosing a reward and learning rate (not a trainer).

    python benchmarks/grpo_lr_proxy.py DIR --lr 1e-3 --steps 150 --new 8 --reward match_then_stop \
        --extra-char-cost 0.0244 --out proxy.jsonl
    python benchmarks/grpo_lr_proxy.py DIR --first-token-values 400    # positional_match's prompt-blind ceiling
    python benchmarks/grpo_lr_proxy.py --hidden 64 --layers 4 --vocab 18992 --new 8 --extra-char-cost 0.04 \
        --lr 7.4e-3 --entropy-coef 0.01 --top-p 0.95 --ignore-eos --reward match_then_stop --steps 75 \
        --out run.jsonl                                               # an eager toy body, built here
    python benchmarks/grpo_lr_proxy.py --plot proxy.png --runs a.jsonl b.jsonl

Why it exists: the strict CPU path scores the full 151,936-id vocabulary through tiled kernels (step 0's
eval of the 8B config on a toy body did not finish in 5 minutes on the 2-core machine), too slow for
the hundreds of steps an lr study needs. This loop runs the same arithmetic in eager torch:
rollouts of ``--prompts`` arithmetic problems x ``--samples`` (``--temp``, ``--top-p``, ``--top-k``), the
reward from configs/partial_credit.py, GRPO advantages (rlalign.algos.advantages.grpo_advantages), one
optimizer step per rollout on loss = -sum(A * log p(token)) / (completion tokens) (ppo_clip's value at
ratio 1: one epoch, one mini-batch), AdamW (the trainer's betas 0.9/0.99, eps 1e-8, no weight decay: the
defaults), grad-norm clip 1.0,
linear warm-up then cosine down to 0.1 x lr over ``--schedule-steps``. Not bit-exact with the trainer
and without KV cache (each decode step recomputes the prefix).

``--hidden H --layers L`` (instead of DIR) builds the 8B's full 151,936-id vocabulary and tokenizer map
around a toy body of width H (scripts/make_qwen3_8b.py's toy_body: intermediate 3H, heads of 16) and
initialises it like the 8B *in signal terms*: std = 0.02 x sqrt(4096 / H) (``--init-std``), so every
matrix's output has the 8B's scale (std x sqrt(fan-in) = 1.28; logits ~ N(0, 1.28^2), entropy 11.11 at
step 0, as on the H200). HF's fixed std 0.02 at H = 64..256 (the proxy's first models, 2026-12-02)
gives logits of std 0.16..0.32 and layers that barely touch the residual stream: a different network.
Under that init an Adam step of lr per coordinate moves a matrix's output by ~lr x H relative to its
scale, so lr x H is the width-invariant knob (lr 2e-4 at H 4096 = 1.28e-2 at 64), to a factor: the 8B
collapsed ~3x sooner in summed lr x H than hidden 64 with 4 or 12 layers (CPU runs of 2026-12-02).
The built body is :class:`ToyQwen3`, eager torch. At the full vocabulary and 64 tokens a step takes ~45 s
at H 64 on 2 cores (the LM head over 5,120 x 151,936 logits), so the lr studies cut both by 8
(``--vocab 18992 --new 8``: the share of the vocabulary drawn per step is kept) and scale the character cost
so that one character moves a completion's advantage as much as at 64 tokens (1/16 at 64 tokens ~ 0.04 at
8, 1/400 ~ 0.0025: not the total cost, which misled the 2026-12-02 proxy). ``--freeze head|body`` trains
only the other part. ``--lm-head-std S`` builds the head that stands for an 8B head drawn N(0, S)
(scripts/make_qwen3_8b.py --lm-head-std; 0: zeros), ``--head-match gap`` (the 8B's lead of S x 4096 nats
for a state aligned with one row) or ``signal`` (its random-logit std S x 64): built_head_std.

Each step prints one JSON line: reward, entropy and p(<eos>) averaged over the completion positions,
completion length in tokens and characters, and ``gain_pos`` / ``gain_neg``: how far the log-probs of
step 1's sampled tokens with advantage > 0.5 / < -0.5 have moved since (nats, in their own contexts),
the per-event update size that decides whether any token can gain mass over a large vocabulary;
``resid_rms`` (the residual stream's RMS into the final norm) and ``logit_std`` (over the vocabulary) at
the completion positions, ``max_p`` (mean top probability), ``zero_std_frac`` (groups whose 8 rewards
are equal: no gradient), ``distinct`` (distinct sampled ids) and ``short_frac`` (sampled ids decoding to
<= 2 characters). Sampling: ``--temp``, ``--top-p``, ``--top-k`` as the rollout engine (the trainer scores
the full softmax at ``--temp``); AdamW ``--betas`` / ``--eps`` / ``--weight-decay``; ``--entropy-coef``
adds - coef x mean entropy to the loss (the trainer's algo.entropy_coef).
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

ROOT = Path(__file__).resolve().parents[1]
PARTIAL_CREDIT = ROOT / "configs" / "partial_credit.py"
EOS, ROW_CHUNK, FULL_VOCAB = 2, 1024, 151936
#: the configs/partial_credit.py constant that --extra-char-cost overrides, per reward (match_then_steep
#: ignored EXTRA_CHAR_COST: runs made before this map ran it at its own 1/16)
CHAR_COST_OF = dict(match_then_stop="EXTRA_CHAR_COST", match_then_steep="STEEP_EXTRA_CHAR_COST")


def load_file_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ToyQwen3(torch.nn.Module):
    """Qwen3's decoder in plain eager torch (pre-norm blocks: RMSNorm, GQA attention with q/k RMSNorm and
    RoPE theta 1e6, SwiGLU MLP; final RMSNorm, untied LM head) over the full vocabulary, for widths the
    2-core machine can afford: the project's strict CPU layers took 3.4 s for one forward of 3,360 tokens
    at width 128, and an uncached rollout runs 64 of them. Not bit-exact with rlalign.models (not needed:
    learning dynamics). Heads of 16 (hidden / 16 query, hidden / 32 key-value heads), intermediate 3 x
    hidden: scripts/make_qwen3_8b.py's toy_body. Init as CausalLM.init_random_: every matrix ~ N(0, std)
    (the LM head ~ N(0, head_std) when given; 0: zeros), norms 1."""

    def __init__(self, hidden: int, layers: int, vocab: int, std: float, seed: int, head_std: float | None = None):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = hidden // 16, hidden // 32, 16

        def matrix(rows, cols, scale=std):
            return torch.nn.Parameter(scale * torch.randn(rows, cols, generator=gen))

        def norm(width):
            return torch.nn.Parameter(torch.ones(width))
        kv = self.kv_heads * self.head_dim
        self.embed = matrix(vocab, hidden)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.ParameterDict(dict(
                attn_norm=norm(hidden), q=matrix(hidden, hidden), k=matrix(kv, hidden), v=matrix(kv, hidden),
                q_norm=norm(self.head_dim), k_norm=norm(self.head_dim), o=matrix(hidden, hidden),
                mlp_norm=norm(hidden), gate=matrix(3 * hidden, hidden), up=matrix(3 * hidden, hidden),
                down=matrix(hidden, 3 * hidden)))
            self.blocks.append(block)
        # drawn last: a different head_std (0: zeros) leaves every other tensor's draw as it is
        self.final_norm = norm(hidden)
        self.lm_head = matrix(vocab, hidden, std if head_std is None else head_std)
        self.inv_freq = 1.0 / (1e6 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    @staticmethod
    def rms(x, weight, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(self, x, positions):                      # x [B, heads, T, d], positions [B, T]
        angles = positions[:, None, :, None].float() * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        even, odd = x[..., : self.head_dim // 2], x[..., self.head_dim // 2:]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], -1)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] left-padded (pad [B, T] True at padding) -> (final-norm hidden [B, T, H], the residual
        stream into the final norm [B, T, H])."""
        batch, length = ids.shape
        positions = (~pad).long().cumsum(-1).clamp(min=1) - 1
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        mask = causal[None, None] & ~pad[:, None, None, :]
        mask = mask | torch.eye(length, dtype=torch.bool)[None, None]    # padding rows attend to themselves
        x = self.embed[ids]
        for b in self.blocks:
            h = self.rms(x, b["attn_norm"])
            q = (h @ b["q"].T).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
            k = (h @ b["k"].T).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            v = (h @ b["v"].T).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            q = self.rope(self.rms(q, b["q_norm"]), positions)
            k = self.rope(self.rms(k, b["k_norm"]), positions)
            repeat = self.heads // self.kv_heads
            att = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), attn_mask=mask)
            x = x + att.transpose(1, 2).reshape(batch, length, -1) @ b["o"].T
            h = self.rms(x, b["mlp_norm"])
            x = x + (torch.nn.functional.silu(h @ b["gate"].T) * (h @ b["up"].T)) @ b["down"].T
        return self.rms(x, self.final_norm), x


def left_padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(map(len, seqs))
    ids = torch.tensor([[0] * (length - len(s)) + s for s in seqs])
    pad = torch.tensor([[True] * (length - len(s)) + [False] * len(s) for s in seqs])
    return ids, pad


def truncate(probs: torch.Tensor, top_p: float, top_k: int, candidates: int = 4096) -> torch.Tensor:
    """The rollout engine's sampling filter: top-k, then the smallest set of top-p mass (unnormalised).
    Top-p looks at each row's ``candidates`` most likely ids (a full sort of 80 x 151,936 per decode step
    is too slow here): a row whose candidates hold < top_p of the mass keeps all ids, i.e. the proxy does
    not drop the low tail (< 5% of the mass at top-p 0.95) of a flat distribution such as step 0's."""
    if 0 < top_k < probs.shape[-1]:                       # top_k >= the vocabulary keeps every id
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0 and bool((probs.max(-1).values * candidates >= top_p * probs.sum(-1)).any()):
        top, order = probs.topk(min(candidates, probs.shape[-1]), dim=-1)
        total = probs.sum(-1, keepdim=True)
        before = top.cumsum(-1) - top                      # mass strictly above each candidate
        cut = (top.sum(-1, keepdim=True) >= top_p * total)  # rows whose nucleus lies within the candidates
        kept = torch.zeros_like(probs).scatter(-1, order, top.masked_fill(before >= top_p * total, 0.0))
        probs = torch.where(cut, kept, probs)
    return probs


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


def built_head_std(std_8b: float, hidden: int, match: str) -> float:
    """The built head's init std standing for an 8B (hidden 4096) head initialised N(0, std_8b).

    After the final RMSNorm |h| = sqrt(hidden), so a head of std s gives random logits of std s x sqrt(hidden)
    and, to a hidden state aligned with one row, that row a lead of s x hidden nats. At hidden 4096 that lead
    is 64x the random std, at hidden H only sqrt(H)x: a narrow proxy cannot match both. ``gap`` keeps that
    lead (S x 4096 nats: 82 at the default 0.02, the one-step one-hot collapse the 8B showed) and overstates
    the random logits by sqrt(4096 / H) (0.72 instead of 0.128 at S 0.002, H 128: entropy within 0.3 nats of
    the uniform's); ``signal`` keeps the random logits (step 0's entropy) and understates that lead by the
    same factor (the body's own convention)."""
    return std_8b * (4096 / hidden if match == "gap" else math.sqrt(4096 / hidden))


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
        last_hidden = final_hidden(model, [seqs[i] for i in live])
        probs = truncate(torch.softmax(last_hidden @ lm_head(model).T / args.temp, -1), args.top_p, args.top_k)
        for i, token in zip(live, sample(probs).tolist()):
            seqs[i].append(token)
            done[i] = token == EOS and not args.ignore_eos
    return seqs


def sample(probs: torch.Tensor) -> torch.Tensor:
    """One id per row of unnormalised ``probs`` (inverse CDF: torch.multinomial takes 0.6 s on 80 x 151,936)."""
    cdf = probs.cumsum(-1)
    u = torch.rand(len(probs), 1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(1).clamp(max=probs.shape[-1] - 1)


def lm_head(model) -> torch.Tensor:
    return model.lm_head if isinstance(model, ToyQwen3) else model.lm_head_weight


def final_hidden(model, seqs) -> torch.Tensor:
    """The final-norm hidden state at each sequence's last token."""
    if isinstance(model, ToyQwen3):
        ids, pad = left_padded(seqs)
        return model(ids, pad)[0][:, -1]
    hidden = model.forward_hidden(ForwardBatch.packed(seqs))
    return hidden[torch.tensor([len(s) for s in seqs]).cumsum(0) - 1]


def hidden_rows(model, seqs, rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(final-norm hidden states, residual stream into the final norm; None for a loaded model) at the
    packed-batch ``rows`` (completion_rows' numbering)."""
    if not isinstance(model, ToyQwen3):
        return model.forward_hidden(ForwardBatch.packed(seqs))[rows], None
    ids, pad = left_padded(seqs)
    hidden, stream = model(ids, pad)
    keep = (~pad).reshape(-1).nonzero().squeeze(1)[rows]      # packed row r -> its place in the padded batch
    return hidden.reshape(-1, hidden.shape[-1])[keep], stream.reshape(-1, stream.shape[-1])[keep]


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
        hidden = hidden_rows(model, seqs, rows)[0]
        return torch.log_softmax(hidden @ lm_head(model).T / temp, -1).gather(1, targets[:, None]).squeeze(1)


def train_step(model, seqs, rows, targets, token_adv, temp, entropy_coef: float) -> dict:
    """Accumulate the gradient of (-sum(A log p) - entropy_coef x sum(H)) / n over row chunks; returns the
    step's mean entropy, p(<eos>), top probability, logit std and residual-stream RMS at those rows."""
    hidden, stream = hidden_rows(model, seqs, rows)
    n, stats = len(rows), dict(entropy=0.0, p_eos=0.0, max_p=0.0, logit_std=0.0)
    for start in range(0, n, ROW_CHUNK):
        part = slice(start, start + ROW_CHUNK)
        logits = hidden[part] @ lm_head(model).T / temp
        logp = torch.log_softmax(logits, -1)
        entropy = -(logp.exp() * logp).sum(-1)
        with torch.no_grad():
            stats["entropy"] += float(entropy.sum())
            stats["p_eos"] += float(logp[:, EOS].exp().sum())
            stats["max_p"] += float(logp.max(-1).values.exp().sum())
            stats["logit_std"] += float(logits.std(-1).sum())
        loss = -(token_adv[part] * logp.gather(1, targets[part, None]).squeeze(1)).sum() / n
        if entropy_coef:
            loss = loss - entropy_coef * entropy.sum() / n
        loss.backward(retain_graph=start + ROW_CHUNK < n)
    stats = {k: v / n for k, v in stats.items()}
    if stream is not None:
        stats["resid_rms"] = float(stream.detach().pow(2).mean(-1).sqrt().mean())
    return stats


def report_first_token_values(model_dir: str, n: int) -> int:
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    answers = [pr.answer for pr in ArithmeticTask(min_digits=2, max_digits=4).train_problems(0, n)]
    values = torch.tensor(first_token_values(vocab_size, answers), dtype=torch.float64)
    print(json.dumps(dict(answers=n, uniform_policy=float(values.mean()), spread=float(values.std()),
                          best=float(values.max()), best_token=token_texts(vocab_size)[int(values.argmax())])))
    return 0


def plot_runs(paths: list[str], out: str) -> int:
    """Reward, entropy and residual-stream RMS per step of each run (a JSON-lines file of this script)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for path in paths:
        rows = [json.loads(line) for line in open(path)]
        steps = [r["step"] for r in rows]
        for ax, key in zip(axes, ("reward", "entropy", "resid_rms")):
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=Path(path).stem)
    for ax, key in zip(axes, ("reward (mean of 80)", "entropy (nats)", "residual RMS into the final norm")):
        ax.set_xlabel("step")
        ax.set_title(key)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", help="a checkpoint dir (or build one: --hidden, --layers)")
    p.add_argument("--hidden", type=int, help="build a full-vocabulary model of this width instead of loading one")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=FULL_VOCAB)
    p.add_argument("--init-std", type=float, help="built model's init std (default: 0.02 x sqrt(4096 / hidden))")
    p.add_argument("--lm-head-std", type=float, help="the 8B's LM-head init std that the built head stands for "
                   "(scripts/make_qwen3_8b.py --lm-head-std; 0: zeros), mapped by --head-match; default: the body's")
    p.add_argument("--head-match", choices=("gap", "signal"), default="gap",
                   help="gap: std = S x 4096 / hidden, so a hidden state aligned with one row leads by the 8B's "
                   "S x 4096 nats; signal: std = S x sqrt(4096 / hidden), the 8B's random-logit std S x 64")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.99))
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--entropy-coef", type=float, default=0.0)
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--freeze", choices=("head", "body"), help="head: the LM head stays at its init (only the "
                   "body trains); body: the embedding, layers and final norm stay (only the head trains); a diagnostic "
                   "of which part drives a collapse")
    p.add_argument("--plot", metavar="PNG", help="instead of training: plot the --runs files")
    p.add_argument("--runs", nargs="*", default=[], help="JSON-lines files of earlier runs (--plot)")
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
    p.add_argument("--extra-char-cost", type=float, help="override the --reward's cost per character beyond the "
                   "answer (match_then_stop's EXTRA_CHAR_COST, match_then_steep's STEEP_EXTRA_CHAR_COST): shorter proxies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON lines here")
    args = p.parse_args(argv)
    if args.plot:
        return plot_runs(args.runs, args.plot)
    if args.first_token_values:
        return report_first_token_values(args.model, args.first_token_values)
    if args.lr is None:
        p.error("--lr is needed to train")
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    credit = load_file_module("partial_credit", PARTIAL_CREDIT)
    if args.extra_char_cost is not None:
        if args.reward not in CHAR_COST_OF:
            p.error(f"--extra-char-cost: --reward {args.reward} has no cost per character; use one of {sorted(CHAR_COST_OF)}")
        setattr(credit, CHAR_COST_OF[args.reward], args.extra_char_cost)
    reward_fn = getattr(credit, args.reward)
    if args.hidden:
        std = 0.02 * math.sqrt(4096 / args.hidden) if args.init_std is None else args.init_std
        head_std = None if args.lm_head_std is None else built_head_std(args.lm_head_std, args.hidden, args.head_match)
        model, vocab_size = ToyQwen3(args.hidden, args.layers, args.vocab, std, args.seed, head_std), args.vocab
    elif args.model:
        model, cfg = load_model(args.model, dtype=torch.float32)
        vocab_size = cfg.vocab_size
    else:
        p.error("give a checkpoint dir or --hidden")
    texts = token_texts(vocab_size)
    char_ids = {c: i for i, c in enumerate(texts[:15]) if c}
    task = ArithmeticTask(min_digits=2, max_digits=4)
    if args.freeze:
        for name, param in model.named_parameters():
            param.requires_grad_((name == "lm_head") == (args.freeze == "body"))
    trained = [param for param in model.parameters() if param.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=tuple(args.betas), eps=args.eps,
                            weight_decay=args.weight_decay)
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
        stats = train_step(model, seqs, rows, targets, adv[owner], args.temp, args.entropy_coef)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trained, args.clip))
        opt.step()
        moved = token_logprobs(model, *tracked[:3], args.temp) - tracked[4]
        record = dict(step=step, lr=lr_at(step, args), reward=float(rewards.mean()), reward_std=float(rewards.std()),
                      **{k: round(v, 5) for k, v in stats.items()}, grad_norm=grad_norm,
                      zero_std_frac=float((rewards.view(-1, args.samples).std(-1) == 0).float().mean()),
                      distinct=int(targets.unique().numel()),
                      short_frac=float(sum(len(texts[t]) <= 2 for t in targets.tolist()) / len(targets)),
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
