"""`longspec train <method>`: the subcommands of each trainer module
(cli/train_<kind>.py exposing ``add_parser(sub)`` that sets ``train_command``)."""

from __future__ import annotations

from longspec.cli import train_external, train_longspec, train_responses, train_tokenswift

TRAINERS = (train_tokenswift, train_longspec, train_external, train_responses)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a drafter for a target")
    methods = p.add_subparsers(dest="method", required=True)
    for trainer in TRAINERS:
        trainer.add_parser(methods)


def run(args) -> int:
    return args.train_command(args)
