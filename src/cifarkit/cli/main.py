"""The `cifarkit` command: each group module registers its subcommands; a command parses its arguments and
calls the layers below, whose functions return data that the command prints."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from cifarkit.cli import data, info, measure, releases, serving, training
from cifarkit.core.errors import LOG_FORMAT, CifarkitError, describe_os_error

EPILOG = ("Start with `cifarkit train` (the fast recipe; `cifarkit recipes` lists the others), then "
          "`cifarkit eval RUN_DIR`. `cifarkit COMMAND --help` shows a command's options.")

# Commands that train: they run on tcmalloc when it is installed (allocator.py).
TRAINING_COMMANDS = ("train", "speedrun", "bench", "profile")


def options(parser: argparse.ArgumentParser | None = None, command: str = "cifarkit"):
    """(command, option strings or the argument's name, dest, help) of every argument of every command, subcommands
    included: what `--help` shows, as data."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from options(subparser, f"{command} {name}")
        else:
            yield command, "/".join(action.option_strings) or action.dest, action.dest, action.help


def build_parser() -> argparse.ArgumentParser:
    # Nothing here imports torch: `cifarkit --help` and argument errors answer at once. Choices that live in the
    # registries (models, benchmark modes) are checked by the stage, whose error lists them.
    import cifarkit
    parser = argparse.ArgumentParser(prog="cifarkit", description=cifarkit.__doc__.strip(), epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"cifarkit {cifarkit.__version__}")
    # No dest: a missing command is then named by its choices, e.g. "required: {import,info,show}".
    sub = parser.add_subparsers(required=True, title="commands")
    for group in (info, data, training, measure, releases, serving):
        group.register(sub)
    return parser


def entry() -> int:
    """The `cifarkit` command as installed: a training command first restarts itself on tcmalloc, then runs."""
    if sys.argv[1:2] and sys.argv[1] in TRAINING_COMMANDS:
        from cifarkit.core import allocator
        allocator.restart_on_tcmalloc(sys.argv[1:])
    return main()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args.func(args)
        sys.stdout.flush()  # a reader that has gone away shows here, not in the flush at exit that prints a traceback
    except BrokenPipeError:
        # `cifarkit data info | head -1`: the reader has what it wanted. As Python's docs advise (signal module,
        # "Note on SIGPIPE"): stdout goes to devnull so that the flush at exit stays quiet, and the exit code is 1.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except CifarkitError as e:
        return _fail(str(e))
    except OSError as e:  # disk full, read-only or missing folders, permissions: the system's words and a way out
        return _fail(describe_os_error(e))
    except KeyboardInterrupt as e:  # a training run says how to continue it; other commands simply stop
        return _fail(str(e) or "interrupted", 130)
    return 0


def _fail(message: str, code: int = 2) -> int:
    rank = os.environ.get("RANK", "0")
    line = f"cifarkit: error: {'' if rank == '0' else f'[rank {rank}] '}{message}"
    if sys.stderr.isatty():
        # A progress bar that Ctrl-C cut short as it was being drawn or cleared may still hold the terminal's line:
        # write over all of it, as tqdm itself does.
        try:
            width = os.get_terminal_size(sys.stderr.fileno()).columns
        except OSError:
            width = 0
        line = "\r" + line.ljust(width - 1)
    print(line, file=sys.stderr)
    return code

