"""The house by purpose (issue 31): the router process speaks to the workers in the wire's vocabulary and never
loads the engine. Checked in a fresh interpreter: the router's app built as `kvseal serve` and `kvseal router` build
it (cli/front.py http_app over a DisaggBackend, the faults' hooks and the ledger), then what sys.modules holds."""

from __future__ import annotations

import json
import subprocess
import sys

ROUTER = """
import json, sys
from kvseal.cli.front import http_app
from kvseal.config import ServerConfig
from kvseal.faults import hooks_from_spec
from kvseal.ledger.store import Ledger
from kvseal.model.locate import load_tokenizer
from kvseal.router.disagg import DisaggBackend

tok, name = load_tokenizer(None)
backend = DisaggBackend(tok, name, ["127.0.0.1:1"], ["127.0.0.1:2"], hooks=hooks_from_spec(None, "router"))
app = http_app(backend, ServerConfig())
print(json.dumps(sorted(sys.modules)))
"""


def test_the_router_process_imports_no_torch_and_no_engine() -> None:
    out = subprocess.run([sys.executable, "-c", ROUTER], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert "kvseal.api.app" in loaded and "kvseal.router.disagg" in loaded  # it did build the router's app
    heavy = [m for m in loaded if m.split(".")[0] == "torch"
             or m.startswith(("kvseal.engine", "kvseal.worker", "kvseal.transfer.", "kvseal.kernels"))]
    assert heavy == [], heavy
