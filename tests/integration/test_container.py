"""The kvseal image, for real (issue 21): `scripts/image.sh --if-stale` builds it (`make image`; in the whole
suite it starts in the background at collection, tests/helpers/image_build.py), or reuses the image already built
from this tree, and a router, a prefill and a decode worker run from it as three containers
on the host's network, on loopback addresses, with fleet keys mounted as a Kubernetes Secret would give them,
wired as deploy/k8s wires them: the router starts with the two workers, which also join through its fleet port.

- Greedy output through the containers equals the unified engine in this process, token for token (seal 10),
  and the KV crossed between the two worker containers (decode's KV endpoint is the name it advertises).
- A drain of the decode container (`podman kill --signal TERM`, what Kubernetes sends at preStop's end) finishes
  the request in flight, whole, before the container exits 0.

podman comes with the repo's setup (scripts/podman_setup.sh); a machine without it fails here, it does not skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvseal import LLM, SamplingParams
from kvseal.model.checkpoint import Checkpoint
from tests.helpers import image_build
from tests.helpers.procs import free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
IMAGE = "localhost/kvseal:latest"
MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "2048", "--kv-pool-tokens", "4096", "--max-num-batched-tokens", "128"]
UID = 10001  # the image's user (Containerfile)


def podman(*args: str, timeout: float = 120) -> str:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: exit {out.returncode}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return out.stdout


class Pod:
    """Three containers from the image: prefill, decode (KV endpoint advertised by name) and the router."""

    def __init__(self, keys: Path) -> None:
        self.keys, self.tag, self.names = keys, uuid.uuid4().hex[:8], []
        p_port, d_port, kv_port, api_port, fleet_port = (free_port() for _ in range(5))
        try:  # a pod that never forms removes what it started
            # as in deploy/k8s: the router starts with these two, and they also join through its fleet port
            common = ["--fleet-keys", "/keys", "--metrics-port", "-1", "--router", f"router@127.0.0.1:{fleet_port}",
                      *ARGS]
            self.prefill = self.run("prefill", "--fleet-member", "prefill", "--host", "127.0.0.1", "--port",
                                    str(p_port), *common)
            self.decode = self.run("decode", "--fleet-member", "decode", "--host", "127.0.0.1", "--port",
                                   str(d_port), "--kv-port", str(kv_port), "--advertise-host", "localhost", *common)
            self.router = self.run("router", "--fleet-member", "router", "--fleet-keys", "/keys", "--host",
                                   "127.0.0.1", "--port", str(api_port), "--fleet-port", str(fleet_port),
                                   "--ledger", "off", "--prefill", f"prefill@127.0.0.1:{p_port}",
                                   "--decode", f"decode@localhost:{d_port}")
            self.url = f"http://127.0.0.1:{api_port}"
            self.kv_endpoint = f"tcp://localhost:{kv_port}"
            wait_until(self.router_up, 180, "the router container's /health")
        except BaseException:
            self.remove()
            raise

    def run(self, role: str, *args: str) -> str:
        name = f"kvseal-test-{role}-{self.tag}"
        # --timeout: a test process killed before its finalizer leaves no container running for ever
        podman("run", "-d", "--name", name, "--network", "host", "--timeout", "900", "-v", f"{self.keys}:/keys:ro",
               IMAGE, role, *args)
        self.names.append(name)
        return name

    def logs(self, name: str) -> str:
        out = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=30, check=False)
        return out.stdout + out.stderr

    def state(self, name: str) -> str:
        return podman("inspect", name, "--format", "{{.State.Status}} {{.State.ExitCode}}").strip()

    def router_up(self) -> bool:
        for name in self.names:
            if not self.state(name).startswith("running"):
                raise RuntimeError(f"{name} is {self.state(name)}:\n" + "\n".join(
                    f"--- {n}:\n{self.logs(n)[-2500:]}" for n in self.names))
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def remove(self) -> None:
        for name in self.names:
            subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def image() -> str:
    assert shutil.which("podman"), "podman is missing: the repo's setup installs it (scripts/podman_setup.sh)"
    code, output = image_build.wait()  # started at collection when the whole suite runs (tests/conftest.py)
    assert code == 0, f"make image failed:\n{output[-5000:]}"
    return IMAGE


@pytest.fixture(scope="module")
def pod(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    keys = tmp_path_factory.mktemp("fleet") / "keys"
    subprocess.run([sys.executable, "-m", "kvseal", "keys", str(keys), "router", "prefill",
                    "decode"], check=True, capture_output=True, timeout=60)
    # the image's user reads the secrets (0600, as kvseal requires): owned by its uid, as a Secret copied into
    # the pod by an init container would be (deploy/k8s)
    chown = ["chown", "-R", f"{UID}:{UID}", str(keys)]
    subprocess.run(chown if os.geteuid() == 0 else ["podman", "unshare", *chown], check=True, timeout=60)
    p = Pod(keys)
    try:
        yield p
    finally:
        p.remove()


def test_the_image_serves_greedy_tokens_equal_to_the_unified_engine(pod: Pod, smol: Checkpoint) -> None:
    info = httpx.get(pod.url + "/info", timeout=10).json()
    # each worker's join found the member the router started with (one entry per role, not two)
    assert sorted(w["role"] for w in info["workers"]) == ["decode", "prefill"]
    wait_until(lambda: pod.logs(pod.router).count(": accepted") >= 2, 60, "both workers' joins")
    (decode,) = (w for w in info["workers"] if w["role"] == "decode")
    assert decode["kv_endpoint"] == pod.kv_endpoint  # advertised by name, and prefill reached it there
    prompts = [smol.tokenizer.encode("The lighthouse keeper wrote in his log: " * 30), smol.tokenizer.encode("Hi!")]
    assert len(prompts[0]) > 128  # several prefill chunks
    ref = [o.outputs[0].token_ids for o in LLM(checkpoint=smol, max_model_len=2048, pool_tokens=4096).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))]
    got = []
    for ids in prompts:
        r = httpx.post(pod.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["token_ids"])
    assert got == ref


def test_a_drained_decode_container_finishes_the_request_in_flight(pod: Pod) -> None:
    body = {"model": MODEL, "prompt": "Write a long story about a lighthouse.", "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", pod.url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        podman("kill", "--signal", "TERM", pod.decode)  # what Kubernetes sends when preStop has run
        events = [first[6:], *(line[6:] for line in lines if line.startswith("data: "))]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 190  # whole, not cut short
    # podman reports "stopped" between the process's exit and its own clean-up, "exited" after: both mean the
    # worker's process ended, and the exit code is the worker's own
    wait_until(lambda: pod.state(pod.decode).split()[0] in ("stopped", "exited"), 60, "the decode container exited")
    assert pod.state(pod.decode).split()[1] == "0", pod.logs(pod.decode)[-2000:]
    assert "drained; exiting" in pod.logs(pod.decode)
