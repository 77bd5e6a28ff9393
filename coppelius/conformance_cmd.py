"""`coppelius conformance`: check backends against the reference (SPEC 14).
The options and the work live in conformance/command.py, shared with
`python -m coppelius.conformance`."""

from __future__ import annotations


def register(subparsers) -> None:
    from coppelius.conformance.command import add_arguments, run

    parser = subparsers.add_parser(
        "conformance", help="check backends against the reference, tensor by tensor",
        description="Drive each backend and the reference on the same inputs and compare "
                    "logits, losses, every gradient, P, M, V, a loss trajectory and exact "
                    "resume (SPEC 14). Exit status 1 when any check fails.")
    add_arguments(parser)
    parser.set_defaults(func=run)
