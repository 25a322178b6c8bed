"""``autopart run DIR [OPTION ...]``: run saved ranks. Under torchrun (``RANK`` set) it runs this
rank; otherwise it starts torchrun itself on the program's world size, passing DIR and the
options on unchanged. The options are ``python -m autopart.runtime.run``'s: its own parser
reads them (here first, so a wrong flag fails before any rank starts)."""

from __future__ import annotations

import argparse
from pathlib import Path

EXAMPLES = """examples:
  autopart run out/ --steps 10 --json
  autopart run out/ --steps 5 --trace trace.json   (then: autopart timeline trace.json)
  autopart run out/ --help                         the options alone
"""


def runtime_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """``autopart.runtime.run``'s parser, named ``autopart run``."""
    from autopart.runtime.run import build_parser

    return build_parser(
        argparse.ArgumentParser(
            prog="autopart run",
            add_help=add_help,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def _options_help() -> str:
    """The runtime's options, as its parser prints them (to list under ``autopart run -h``)."""
    text = runtime_parser(add_help=False).format_help()
    _, sep, options = text.partition("options:\n")
    return f"run options (given to every rank):\n{options}" if sep else ""


def add_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "run",
        help="run saved ranks (under torchrun, or launching it)",
        usage="autopart run [-h] DIR [OPTION ...]",
        description="Run the saved ranks of DIR: this rank under torchrun (RANK set), else start\n"
        "torchrun on the program's world size with DIR and the options unchanged.",
        epilog=f"{_options_help()}\n{EXAMPLES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("dir", metavar="DIR", help="folder written by Program.save() (holds plan.json)")
    options = r.add_argument(
        "options",
        nargs=argparse.REMAINDER,
        metavar="OPTION",
        help="the run options below, after DIR",
    )
    options.required = False  # no options is fine (argparse marks a REMAINDER required)


def main(a: argparse.Namespace) -> int:
    import os

    from autopart.layout import Plan
    from autopart.program import libraries
    from autopart.program.format import read_head
    from autopart.runtime import dirlock
    from autopart.runtime.launch import launch
    from autopart.runtime.run import check_args, run

    argv = [a.dir, *a.options]
    args = runtime_parser().parse_args(argv)
    if "RANK" in os.environ:
        return run(args)
    head = read_head(args.dir)
    world = _world_before_launch(args.dir, head)
    check_args(args, head, Plan.from_json(head["plan"]))  # refused here once, not per rank
    libraries.trusted(head.get("libraries", {}), args.library_ops, Path(args.dir))
    if args.checkpoint_dir is not None:  # another run saving there: refused before any rank
        dirlock.check_free(args.checkpoint_dir)
    print(
        f"launching {world} ranks: torchrun --standalone --nproc-per-node {world} "
        f"-m autopart.runtime.run {' '.join(argv)}"
    )
    launch(world, ["-m", "autopart.runtime.run", *argv], stream=True, timeout_s=None)
    return 0


def _world_before_launch(folder: str, head: dict) -> int:
    """The world size to launch, checked against the plan's mesh and the rank folders the
    program lists before any rank is spawned."""
    from autopart.errors import AutopartError
    from autopart.layout import Plan
    from autopart.program.format import check_ranks

    world, mesh = head["world_size"], Plan.from_json(head["plan"]).mesh
    if world != mesh.size:
        raise AutopartError(
            f"{folder}/plan.json: world_size {world} but the plan's mesh {mesh} has "
            f"{mesh.size} ranks",
            hint="the program folder was edited or mixed up; re-save it with Program.save()",
        )
    missing = [r for r in range(world) if f"rank{r:05d}/program.json" not in head["files"]]
    if missing:
        raise AutopartError(
            f"{folder}: no program for rank {missing[0]} of {world} in plan.json",
            hint="re-save the program, or copy the whole folder",
        )
    check_ranks(folder, head)  # every rank's program and files, before any rank starts
    return world
