"""kvseal's command line: `kvseal serve [MODEL]` and friends (`--help` documents every flag).

One module per subcommand, each with its parser (`add_parser`) and what it does (`cmd_*`): serve.py, worker.py
(prefill and decode), router.py, drain.py, tools.py (audit, doctor, incidents, bench; keys is auth/options.py's).
serve, prefill, decode and router build their flags from config fields (kvseal/config_args.py), and what they run
with back from the parsed flags; base.HAND_WRITTEN lists the few flags that are files read at start.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvseal.auth.options import add_keys_command
from kvseal.cli import drain, router, serve, tools, worker
from kvseal.config_args import check_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvseal", description="A disaggregated LLM server with sealed KV.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_parser(sub)
    worker.add_parsers(sub)
    router.add_parser(sub)
    drain.add_parser(sub)
    add_keys_command(sub)
    tools.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(a, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_args(a)  # every setting this command has as a flag, before anything starts
        return int(a.func(a))
    except ValueError as exc:  # configuration errors: name the field, the value and the fix
        print(f"kvseal: {exc}", file=sys.stderr)
        return 2
