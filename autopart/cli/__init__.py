"""The command line: ``autopart SUBCOMMAND``, one module per subcommand.

Each of ``demo``, ``verify``, ``zoo``, ``inspect``, ``run``, ``train``, ``timeline``,
``simulate`` and ``plan`` is a module here with ``add_parser(sub)`` (its flags and help) and ``main(args) -> int``;
``common`` holds the flag groups several take, ``report`` the rich tables ``inspect`` and
``demo`` print. ``main`` parses, dispatches, and turns an ``AutopartError`` into
``autopart CMD: error: ...`` on stderr and exit code 2, and a Ctrl-C into ``autopart CMD:
interrupted`` (a launch adds ``: the N ranks were stopped too``) and exit code 130.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from autopart import __version__
from autopart.cli import demo, inspect, plan, run, simulate, timeline, train, verify, zoo
from autopart.errors import AutopartError

EPILOG = """examples:
  autopart demo                                   train a small GPT on 4 CPU ranks (tp × pp), check parity
  autopart verify --model examples/nanogpt.py:make --dp 2 --microbatches 2
  autopart inspect --model examples/hf_gpt2.py:make --dp 2 --rank 1 --dot rank1.dot
  torchrun --standalone --nproc-per-node 2 -m autopart.runtime.run out/ --steps 10
  autopart run out/ --steps 10                    (launches torchrun itself when not under it)
  autopart train train.toml                       train with a config: LR schedule, clipping, eval,
                                                  checkpoints and resume, metrics
  autopart timeline trace.json -o timeline.png    draw a --trace file: one row per rank
  autopart simulate --shape gpt3-175b --gpus 1024 --tp 8 --pp 8 --global-batch 1536 --recompute full
                                                  predict one iteration on a GPU cluster
  autopart plan --shape megatron-1t --gpus 3072 --global-batch 3072
                                                  search for the fastest plan that fits

a model SPEC is path/to/file.py:make or package.module:make, where make() returns
(model, (input_ids, labels)) with int64 (batch, seq) token tensors. The examples/ files are in
the source checkout; an installed package has autopart.models.nanogpt:make and
autopart.models.zoo:llama (any architecture of docs/compatibility.md) everywhere.
"""

# the subcommands, in the order --help lists them
COMMANDS = {
    "demo": demo,
    "verify": verify,
    "zoo": zoo,
    "inspect": inspect,
    "run": run,
    "train": train,
    "timeline": timeline,
    "simulate": simulate,
    "plan": plan,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autopart",
        description="Compile an unmodified PyTorch GPT into one parallel program per rank.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--version",
        action="version",
        version=f"autopart {__version__} (torch {metadata.version('torch')})",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(sub)
    return p


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of subcommand ``command`` (``parser`` itself when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser, with its usage line, not the top level's
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command].main(args)
    except AutopartError as exc:
        print(f"autopart {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # a launch's says what it stopped: "the 2 ranks were ..."
        said = f": {exc}" if str(exc) else ""
        print(f"autopart {args.command}: interrupted{said}", file=sys.stderr)
        return 130


__all__ = ["build_parser", "main"]
