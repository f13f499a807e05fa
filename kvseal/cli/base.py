"""What every subcommand module of kvseal/cli/ shares: how a subcommand is made, and the flags no config field
declares."""

from __future__ import annotations

import argparse

Subparsers = argparse._SubParsersAction  # argparse's own name for `add_subparsers()`' result

# serve, prefill, decode and router take every other flag from a config field (kvseal/config.py,
# kvseal/config_fleet.py). These are files, or a member of one, read once at start: what the process keeps, and
# what a worker gets in its WorkerSpec, is what was read, never the path (tests/unit/test_cli_flags.py checks it).
HAND_WRITTEN = {
    "--api-keys": "the tenants file, read into ServerConfig's key digests and tenants (tenancy/tenant_file.py)",
    "--chat-template": "a jinja2 file, read and compiled at start; the router keeps its text",
    "--fleet-keys": "a `kvseal keys` folder, loaded into MemberKeys (auth/options.py)",
    "--fleet-member": "which member's keypair of --fleet-keys this process is",
    "--metrics-token-file": "the metrics token, kept as its SHA-256 only (metrics/token.py)",
}


def command(sub: Subparsers[argparse.ArgumentParser], name: str, help: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
