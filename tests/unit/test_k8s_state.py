"""deploy/k8s's routers and their shared state (issue 34), rendered offline as in test_k8s_manifests.py: two routers
keep every tenant's limits and stored responses in the folder's Redis, reading its password and the state secret
from generated Secrets; Redis gets the password and never the secret; the password is in no manifest and on no
command line (Redis is started here from the manifest's own command and config, with the real redis-server); only
the routers reach Redis; one router always stays through a voluntary disruption; Redis keeps its data on a
persistent volume, as a non-root user, within its memory limit.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
import yaml

from kvseal.config import ServerConfig
from kvseal.tenancy.sealer import read_secret
from tests.helpers.k8s import (
    ROLES,
    ROOT,
    STATE_PASSWORD,
    STATE_SECRET,
    Objects,
    kvseal_args,
    pod_labels,
    pod_spec,
    render_fresh,
    secret_mount,
    selects,
)
from tests.helpers.procs import free_port

REDIS = ("StatefulSet", "kvseal-redis")


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> Objects:
    return render_fresh(tmp_path_factory.mktemp("deploy"))[0]


def secrets_of(spec: dict[str, Any]) -> set[str]:
    """Every Secret a pod spec reads: volumes (projected too), env and envFrom of every container."""
    names = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    names |= {s["secret"]["name"] for v in spec["volumes"] for s in v.get("projected", {}).get("sources", [])
              if "secret" in s}
    for c in spec.get("initContainers", []) + spec["containers"]:
        names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                  if "secretKeyRef" in e.get("valueFrom", {})}
        names |= {e["secretRef"]["name"] for e in c.get("envFrom", []) if "secretRef" in e}
    return names


def test_two_routers_keep_the_tenants_state_in_redis_with_the_password_and_secret_from_their_secrets(
        objects: Objects, tmp_path: Path) -> None:
    router = objects[ROLES["router"]]
    assert router["spec"]["replicas"] == 2
    assert router["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0  # a rollout keeps both serving
    spec = pod_spec(objects, *ROLES["router"])
    a = kvseal_args(spec)
    url = urlsplit(a.state)
    assert url.scheme == "redis" and url.password is None  # the password is read from a file, never the URL
    # the address is a Service over the Redis pods alone, at their Redis port
    svc = objects[("Service", url.hostname)]["spec"]
    picked = {n for n, labels in pod_labels(objects).items() if selects({"matchLabels": svc["selector"]}, labels)}
    assert picked == {REDIS[1]}
    (port,) = [p for p in svc["ports"] if p["port"] == url.port]
    (c,) = pod_spec(objects, *REDIS)["containers"]
    assert any(p["name"] == port["targetPort"] and p["containerPort"] == 6379 for p in c["ports"])
    # each file is a key of its generated Secret (a new one rolls the routers) and kvseal accepts what it holds
    for path, prefix, value in ((a.state_password_file, "state-password-", STATE_PASSWORD),
                                (a.state_secret_file, "state-secret-", STATE_SECRET)):
        secret, key = secret_mount(spec, path)
        assert secret.startswith(prefix)
        data = objects[("Secret", secret)]["data"]
        assert set(data) == {key}
        mounted = tmp_path / key
        mounted.write_bytes(base64.b64decode(data[key]))
        assert read_secret(str(mounted), path, 32) == value.encode()
    ServerConfig(state=a.state, state_password_file=a.state_password_file, state_secret_file=a.state_secret_file,
                 state_lease_s=a.state_lease_s)  # the fields' own checks
    # the password reaches the routers and Redis; the secret that seals stored responses, the routers alone
    for (kind, name), o in objects.items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        read = secrets_of(o["spec"]["template"]["spec"])
        assert any(s.startswith("state-password-") for s in read) == (name in ("kvseal-router", REDIS[1])), name
        assert any(s.startswith("state-secret-") for s in read) == (name == "kvseal-router"), name


def test_the_redis_password_and_the_state_secret_are_in_no_manifest_but_their_secrets(objects: Objects) -> None:
    for (kind, name), o in objects.items():
        text = yaml.safe_dump(o)
        if kind == "Secret":
            assert "stringData" not in o, name
            continue
        for value in (STATE_PASSWORD, STATE_SECRET):
            assert value not in text, (kind, name)
    # every file a Secret is generated from is one git ignores, so none is ever committed
    kustomization = yaml.safe_load((ROOT / "deploy" / "k8s" / "kustomization.yaml").read_text())
    files = [f"deploy/k8s/{f}" for g in kustomization["secretGenerator"] for f in g["files"]]
    assert {"deploy/k8s/state-password", "deploy/k8s/state-secret"} <= set(files)
    out = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *files], capture_output=True,
                         text=True, check=False)
    assert out.stdout.split() == files


@contextlib.contextmanager
def redis_from_the_manifest(objects: Objects, root: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """The Redis container's own command, run here with the real redis-server: each of its mounts is a folder under
    `root` holding what the pod's volume would hold (the ConfigMap's and the Secret's keys as files), and the
    port a free one on loopback. redis-server is reached through a shim that writes the arguments it gets to
    `root`/argv (Redis rewrites its process title, so /proc shows them no more). Yields (the process, its port,
    the data folder)."""
    exe = shutil.which("redis-server")
    assert exe, "redis-server is missing: `make setup` installs it (scripts/setup.sh)"
    shim = root / "bin" / "redis-server"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nfor a in "$@"; do echo "$a"; done > {root}/argv\nexec {exe} "$@"\n')
    shim.chmod(0o755)
    spec = pod_spec(objects, *REDIS)
    (c,) = spec["containers"]
    port = free_port()
    volumes = {v["name"]: v for v in spec["volumes"]}
    moved = {}
    for m in c["volumeMounts"]:
        here = root / m["name"]
        here.mkdir()
        moved[m["mountPath"]] = str(here)
        source = volumes.get(m["name"], {})
        if "configMap" in source:
            data = objects[("ConfigMap", source["configMap"]["name"])]["data"]
            for key, text in data.items():
                (here / key).write_text(text)
        elif "secret" in source:
            for key, b64 in objects[("Secret", source["secret"]["secretName"])]["data"].items():
                (here / key).write_bytes(base64.b64decode(b64))

    def local(text: str) -> str:
        for path in sorted(moved, key=len, reverse=True):
            text = text.replace(path, moved[path])
        return text.replace("6379", str(port)).replace("bind * -::*", "bind 127.0.0.1")

    for conf in (Path(moved[m["mountPath"]]) for m in c["volumeMounts"] if "configMap" in volumes.get(m["name"], {})):
        for f in conf.iterdir():
            f.write_text(local(f.read_text()))
    p = subprocess.Popen([local(x) for x in c["command"] + c.get("args", [])], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env={**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}"})
    data = Path(moved[next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "data")])
    try:
        yield p, port, data
    finally:
        p.kill()
        p.wait(10)


def _ping(client: redis.Redis, p: subprocess.Popen[bytes]) -> bool:
    for _ in range(400):
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            assert p.poll() is None, "redis-server exited: the manifest's command or redis.conf is wrong"
            time.sleep(0.05)
    raise AssertionError("redis-server did not answer")


def test_redis_starts_from_the_manifest_with_the_password_of_its_secret_never_on_its_command_line(
        objects: Objects, tmp_path: Path) -> None:
    with redis_from_the_manifest(objects, tmp_path) as (p, port, data):
        assert _ping(redis.Redis(host="127.0.0.1", port=port, password=STATE_PASSWORD), p)
        with pytest.raises(redis.AuthenticationError):  # NOAUTH: nothing answers without the password
            redis.Redis(host="127.0.0.1", port=port).get("x")
        argv = (tmp_path / "argv").read_text()  # what redis-server was started with: its config file, no password
        assert argv.split() == [str(tmp_path / "config" / "redis.conf")], argv
        c = redis.Redis(host="127.0.0.1", port=port, password=STATE_PASSWORD, decode_responses=True)
        assert c.config_get("appendonly") == {"appendonly": "yes"}  # persistence: every write logged
        assert c.config_get("dir") == {"dir": str(data)}  # on the volume claim's mount
        assert c.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}  # never a fresh limit
        # the readiness probe authenticates with the Secret's password, from its environment
        (container,) = pod_spec(objects, *REDIS)["containers"]
        probe = container["readinessProbe"]["exec"]["command"]
        local = [x.replace("6379", str(port)).replace("/secret/", f"{tmp_path}/state-password/") for x in probe]
        assert subprocess.run(local, capture_output=True, timeout=30, check=False).returncode == 0
        assert STATE_PASSWORD not in " ".join(probe)
        (tmp_path / "state-password" / "state-password").write_text("not-the-password\n")
        assert subprocess.run(local, capture_output=True, timeout=30, check=False).returncode != 0


def test_only_the_routers_reach_redis_and_redis_reaches_nothing(objects: Objects) -> None:
    labels = pod_labels(objects)
    redis_labels = labels[REDIS[1]]
    assert redis_labels.get("kvseal.dev/fleet-member") != "true"  # so it reaches no worker's private port
    policies = [o["spec"] for (kind, _), o in objects.items()
                if kind == "NetworkPolicy" and selects(o["spec"]["podSelector"], redis_labels)]
    assert policies and all("Ingress" in p["policyTypes"] for p in policies)
    allowed: set[str] = set()
    for rule in (r for p in policies for r in p.get("ingress", [])):
        assert "from" in rule and {p["port"] for p in rule["ports"]} == {6379}, rule  # no rule open to all
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, peer  # this namespace's pods, no address block
            allowed |= {n for n, pod in labels.items() if selects(peer["podSelector"], pod)}
    assert allowed == {"kvseal-router"}
    # and it opens no connection of its own (Egress with no rule: nothing, not even DNS)
    assert any("Egress" in p["policyTypes"] for p in policies)
    assert not [e for p in policies for e in p.get("egress", [])]


def test_one_router_always_stays_through_a_voluntary_disruption(objects: Objects) -> None:
    labels = pod_labels(objects)
    budgets = [o["spec"] for (kind, _), o in objects.items()
               if kind == "PodDisruptionBudget" and selects(o["spec"]["selector"], labels["kvseal-router"])]
    (pdb,) = budgets
    assert pdb["minAvailable"] == 1 and "maxUnavailable" not in pdb
    assert {n for n, pod in labels.items() if selects(pdb["selector"], pod)} == {"kvseal-router"}
    assert objects[ROLES["router"]]["spec"]["replicas"] > pdb["minAvailable"]  # so a node drain can proceed


def _bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "kb": 1000, "mb": 1000**2, "gb": 1000**3}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_redis_keeps_its_data_on_a_persistent_volume_as_a_non_root_user_within_its_memory(objects: Objects) -> None:
    sts = objects[REDIS]["spec"]
    spec = sts["template"]["spec"]
    (c,) = spec["containers"]
    assert c["image"] == "docker.io/library/redis:7.2-bookworm"  # kustomization.yaml `images` names it
    claims = {t["metadata"]["name"] for t in sts["volumeClaimTemplates"]}
    data = next(m for m in c["volumeMounts"] if m["name"] in claims)
    (config,) = [v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v]
    (conf,) = objects[("ConfigMap", config)]["data"].values()
    settings = dict(line.split(" ", 1) for line in conf.splitlines() if line and not line.startswith("#"))
    assert settings["dir"] == data["mountPath"] and settings["appendonly"] == "yes"
    assert _bytes(c["resources"]["limits"]["memory"]) > _bytes(settings["maxmemory"])  # room for the rewrite's fork
    assert c["resources"]["requests"]["memory"] and c["resources"]["requests"]["cpu"]
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] and pod["runAsUser"] != 0 and pod["fsGroup"] == pod["runAsGroup"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == [
        "ALL"]
