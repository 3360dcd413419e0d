"""``rlalign bench BENCHMARK [options]``: the project's benchmarks, one sub-command each.

Add a benchmark by adding ``name: module`` to ``BENCHMARKS`` (a module of :mod:`rlalign.bench`); the module
provides ``HELP``, ``add_arguments(parser)`` and ``run_cli(args) -> int``.
"""

from __future__ import annotations

from rlalign.bench import rollout

BENCHMARKS = {
    "rollout": rollout,
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark (rollout, ...)")
    choices = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, module in BENCHMARKS.items():
        sub = choices.add_parser(name, help=module.HELP, description=module.__doc__.split("\n\n")[0])
        module.add_arguments(sub)
        sub.set_defaults(func=module.run_cli)
    parser.set_defaults(func=lambda args: _usage(parser))


def _usage(parser) -> int:
    parser.print_help()
    return 2
