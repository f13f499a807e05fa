"""The KV transports every seal test runs with: ZeroMQ always, NIXL where its extra is installed (setup does)."""

from __future__ import annotations

import importlib.util

import pytest

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
KV_TRANSPORTS = ["zmq", pytest.param("nixl", marks=pytest.mark.skipif(
    not HAVE_NIXL, reason="the nixl extra is not installed (scripts/setup.sh installs it)"))]
