"""The KV transports every seal test runs with: ZeroMQ and NIXL. scripts/setup.sh installs the nixl extra, so a
missing NIXL fails these tests loudly instead of skipping half of them."""

from __future__ import annotations

KV_TRANSPORTS = ["zmq", "nixl"]
