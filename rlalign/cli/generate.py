"""``rlalign generate``: sample completions from a local checkpoint, with per-token logprobs.

    rlalign generate --model DIR --prompt TEXT [--prompt TEXT ...] [--n N] [--max-new-tokens L]
                     [--temperature T] [--top-p P] [--top-k K] [--seed S] [--profile strict|native|portable]
                     [--chat] [--dtype float32|bfloat16] [--device cpu|cuda] [--json]

Same seed -> same tokens and logprobs whatever --n, the number of prompts or their order
(the rollout engine, :func:`rlalign.rollout.completions.generate_completions`; its results equal
the simple loop of :mod:`rlalign.models.generate` bit for bit). ``--json`` prints
``{"completions": [{"prompt", "sample", "tokens", "text", "logprobs"}]}``.
"""

from __future__ import annotations

import argparse
import json
import sys

from rlalign.bench.args import non_negative_int, positive_int, seed_int
from rlalign.cli._device import require_device
from rlalign.contract import use_profile
from rlalign.contract.errors import RLAlignError
from rlalign.models import load_model, load_tokenizer
from rlalign.rollout.completions import generate_completions
from rlalign.train.config import memory_problem


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="sample completions from a local checkpoint directory",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("--prompt", action="append", required=True, metavar="TEXT", help="prompt (repeatable)")
    parser.add_argument("--n", type=positive_int, default=1, help="samples per prompt (default 1)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="L", help="default 32")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T", help="default 1.0; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling (default 1.0 = off)")
    parser.add_argument("--top-k", type=non_negative_int, default=0, metavar="K", help="top-k sampling (default 0 = off)")
    parser.add_argument("--seed", type=seed_int, default=0, metavar="S", help="default 0")
    parser.add_argument("--profile", choices=("strict", "native", "portable"), default="strict", help="default strict")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="compute dtype (default: the checkpoint's torch_dtype)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="KV cache page size (default 16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _check_size(args) -> None:
    """Completions that would not fit in memory are refused before any work (the trainer's estimate and rule)."""
    problem = memory_problem(f"--n {args.n} x {len(args.prompt)} prompt(s)", args.n * len(args.prompt),
                             args.max_new_tokens, fix="lower --n or --max-new-tokens")
    if problem:
        raise RLAlignError(problem)


def _check_request(model, tokenizer, args) -> None:
    """What ``rlalign train`` refuses for its prompts, refused here too: no EOS, characters the tokenizer cannot
    encode (they would become its unknown token), no room for the completion."""
    if not (tokenizer.eos_token_ids or model.config.eos_token_ids):
        raise RLAlignError(f"{args.model}: no eos token (tokenizer_config.json eos_token or config.json eos_token_id); "
                           "completions could never stop")
    limit = model.config.max_position_embeddings
    for prompt in args.prompt:
        problem = tokenizer.encodability_problem(prompt)
        if problem:
            raise RLAlignError(problem)
        length = len(tokenizer.encode(prompt, chat=args.chat))
        if length + args.max_new_tokens > limit:
            raise RLAlignError(f"prompt {prompt[:40]!r} is {length} tokens; with --max-new-tokens {args.max_new_tokens} "
                               f"it exceeds the model's {limit} positions (max_position_embeddings); shorten it")


def run(args: argparse.Namespace) -> int:
    try:
        require_device(args.device)
        _check_size(args)
        model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
        tokenizer = load_tokenizer(args.model)
        _check_request(model, tokenizer, args)
        with use_profile(args.profile):
            completions = generate_completions(model, args.prompt, tokenizer=tokenizer, n=args.n,
                                               max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                               top_p=args.top_p, top_k=args.top_k, seed=args.seed, chat=args.chat,
                                               page_size=args.page_size)
    except (RLAlignError, ValueError) as exc:  # one line, exit 2, as rlalign.cli.main does
        print(f"rlalign generate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"completions": [
            {"prompt": c.prompt, "sample": c.sample_index, "tokens": c.tokens, "text": c.text, "logprobs": c.logprobs}
            for c in completions]}))
    else:
        for c in completions:
            _print_completion(c, tokenizer)
    return 0


def _print_completion(c, tokenizer) -> None:
    print(f"=== prompt {c.prompt_index} sample {c.sample_index} ({len(c.tokens)} tokens, finish: {c.finish_reason})")
    print(f"prompt: {c.prompt!r}")
    print(f"text:   {c.text!r}")
    pieces = [f"{tok}:{tokenizer.decode([tok], skip_special_tokens=False)!r}:{lp:.6f}"
              for tok, lp in zip(c.tokens, c.logprobs)]
    print("tokens (id:piece:logprob): " + " ".join(pieces))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlalign generate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
