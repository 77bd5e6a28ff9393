"""The `coppelius` command line. Each subcommand lives in its own module,
which adds its parser with `register(subparsers)` and sets `func(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import re
import signal
import sys

# Nothing of the project, nor NumPy, is imported at this module's top: the
# console script imports it first, and a Ctrl-C while the rest is imported
# (about a second) must end as one line, not a traceback (main).

# module -> the subcommands it registers
MODULES = (
    "coppelius.tokenize",  # tokenize
    "coppelius.train_options",  # train (its run loop: coppelius.train)
    "coppelius.evaluate",  # eval
    "coppelius.report",  # inspect, report
    "coppelius.sample",  # sample
    "coppelius.exchange",  # export, import
    "coppelius.conformance.command",  # conformance
    "coppelius.program",  # program
    "coppelius.bench",  # bench
)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (the whole usage block hid
    the reason) and negative numbers of every spelling read as values."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse takes only "-1" and "-.5" for numbers: "--lr -inf" or
        # "--lr -3e-4" read the value as an unknown option. Values that look
        # like numbers (decimal, exponent, fraction, inf, nan) are values;
        # the value's own check then says what is wrong with it.
        self._negative_number_matcher = re.compile(
            r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?(/\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Terminated(BaseException):
    """SIGTERM or SIGHUP outside the training loop: unwinds like Ctrl-C, so
    that every publication in progress removes its temporary."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate(signum, frame):
    raise Terminated(signum)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="coppelius",
        description="Train a small GPT-style language model with exact, checkable semantics.",
        epilog="The exact semantics (cited as SPEC §N in messages and help): docs/SPEC.md "
               "in the project's source.")
    parser.add_argument("--version", action="version", version=f"coppelius {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.subcommands = sub.choices  # name -> its parser, for its usage errors
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # subcommand not built in this tree
                continue
            raise
        module.register(sub)
    return parser


def version() -> str:
    """The installed distribution's version (a source tree run as is has none)."""
    from importlib import metadata

    try:
        return metadata.version("coppelius")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll says POLLERR)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no stdout
        return False


def main(argv=None) -> int:
    """The command line: its status. A Ctrl-C at any time, the imports
    included, ends with one line and status 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("coppelius: interrupted", file=sys.stderr)
        return 130


def _main(argv) -> int:
    from coppelius.reference.errors import CoppeliusError

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's to refuse, pointing at its own --help
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --gpus N starts again
    # a path or a text that is not UTF-8 is printed with escapes, not refused
    # by the printing (a traceback) after the work is done
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError):
            pass
    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, _terminate)
        except ValueError:  # not the main thread: the signals stay as they are
            pass
    try:
        status = args.func(args)
        sys.stdout.flush()  # what is still buffered fails here, not at the exit's flush
    except CoppeliusError as e:
        print(f"coppelius {args.command}: error: {e}", file=sys.stderr)
        return e.exit_status
    except BrokenPipeError as e:
        if not _stdout_closed():
            print(f"coppelius {args.command}: error: {e.strerror or e}", file=sys.stderr)
            return 2
        # `coppelius inspect ... | head`: the reader has what it wanted. The
        # rest goes to /dev/null, so that the exit's flush fails no more.
        from coppelius.plan import silence

        silence(sys.stdout)
        return 0
    except OSError as e:  # a file-system failure nothing more specific caught
        where = f"{e.filename}: " if e.filename else ""
        print(f"coppelius {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"coppelius {args.command}: error: out of memory (a smaller batch, model or "
              f"input may fit)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"coppelius {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"coppelius {args.command}: stopped by signal {e.signum}", file=sys.stderr)
        return 128 + e.signum
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
