"""The `coppelius` command line. Each subcommand lives in its own module,
which adds its parser with `register(subparsers)` and sets `func(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

from coppelius.reference.errors import CoppeliusError

# module -> the subcommands it registers
MODULES = (
    "coppelius.data",  # tokenize
    "coppelius.run",  # train
    "coppelius.evaluate",  # eval
    "coppelius.report",  # inspect, report
    "coppelius.sample",  # sample
    "coppelius.exchange",  # export, import
    "coppelius.conformance_cmd",  # conformance
    "coppelius.program_cmd",  # program
    "coppelius.bench",  # bench
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coppelius",
        description="Train a small GPT-style language model with exact, checkable semantics.",
        epilog="The exact semantics (cited as SPEC §N in messages and help): docs/SPEC.md "
               "in the project's source.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # subcommand not built in this tree
                continue
            raise
        module.register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = args.func(args)
    except CoppeliusError as e:
        print(f"coppelius {args.command}: error: {e}", file=sys.stderr)
        return e.exit_status
    except OSError as e:  # a file-system failure nothing more specific caught
        where = f"{e.filename}: " if e.filename else ""
        print(f"coppelius {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"coppelius {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
