"""deploy/k8s, checked offline (issue 21): no cluster is reachable here, so the manifests are rendered with
`kubectl kustomize` (with a key set made by `kvseal keys`, as docs/deploy.md says), validated in strict mode
against the Kubernetes API schemas (kubernetes-validate, 1.30), and their wiring is checked against kvseal itself:
every container's arguments parse with kvseal's own parser, the peers the routers start with are the stable
names of the workers' pod 0, workers join every router through a headless Service over the routers, each pod's
secret key reaches only its member, the memory request holds the KV pool the flags ask for, the grace period
outlasts the drain, only fleet members reach the control and KV ports, and the workers' metrics token (issue 30)
reaches the workers and the PodMonitor of deploy/prometheus, never the router or a probe. The routers' shared
state in Redis (issue 34) is checked in tests/unit/test_k8s_state.py.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest

from kvseal.metrics.token import token_sha256
from tests.helpers.k8s import (
    METRICS_TOKEN,
    OPERATOR_KINDS,
    ROLES,
    Objects,
    kvseal_args,
    pod_labels,
    pod_spec,
    render_fresh,
    secret_mount,
    selects,
)

KV_BYTES_PER_TOKEN = 23040  # SmolLM2-135M, bf16 KV (a worker's /info: kv_bytes_per_token)
RUNTIME_MIB = 400  # weights and runtime of a worker of the bundled model, measured (docs/deploy.md)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Objects, Objects]:
    """(deploy/k8s, deploy/prometheus) rendered with a fresh key set, API keys and metrics token."""
    return render_fresh(tmp_path_factory.mktemp("deploy"))


@pytest.fixture(scope="module")
def objects(rendered: tuple[Objects, Objects]) -> Objects:
    return rendered[0]


def test_every_container_runs_a_kvseal_command_that_parses(objects: dict[tuple[str, str], dict[str, Any]]) -> None:
    for role, (kind, name) in ROLES.items():
        spec = pod_spec(objects, kind, name)
        a = kvseal_args(spec)
        assert a.command == role and a.host == "0.0.0.0"
        assert a.fleet_keys == "/keys" and a.fleet_member == role  # keys: a port off loopback needs them
        (c,) = spec["containers"]
        assert c["image"] == "localhost/kvseal:latest"
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001


def test_the_router_starts_with_pod_0_of_each_role_and_workers_join_every_router(
        objects: dict[tuple[str, str], dict[str, Any]]) -> None:
    router = kvseal_args(pod_spec(objects, "Deployment", "kvseal-router"))
    for role, peers in (("prefill", router.prefill), ("decode", router.decode)):
        kind, name = ROLES[role]
        sts = objects[(kind, name)]
        worker = kvseal_args(sts["spec"]["template"]["spec"])
        headless = objects[("Service", sts["spec"]["serviceName"])]
        assert headless["spec"]["clusterIP"] == "None"
        # the router's static peer is pod 0's DNS name in the headless Service, at the worker's control port, and
        # the same endpoint pod 0 advertises when it joins (so the router knows it as one member, not two)
        assert peers == [f"{role}@{name}-0.{name}:{worker.port}"]
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        assert "--advertise-host=$(POD_NAME)." + name in c["args"]
        assert any(e["name"] == "POD_NAME" and e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
                   for e in c["env"])
        # the window the router serves fits in every worker's pool (the router checks it at start: seal 7)
        assert worker.max_model_len == router.max_model_len <= worker.kv_pool_tokens


def test_workers_join_every_router_through_a_headless_service_over_the_routers(objects: Objects) -> None:
    """Each worker's --router names a headless Service (its name resolves to every router pod, worker/join.py), over
    the routers alone, at their fleet port, listing routers that are not ready yet (they get ready once workers
    joined)."""
    router = kvseal_args(pod_spec(objects, *ROLES["router"]))
    for role in ("prefill", "decode"):
        worker = kvseal_args(pod_spec(objects, *ROLES[role]))
        member, _, hostport = worker.router.rpartition("@")
        host, _, port = hostport.rpartition(":")
        assert member == router.fleet_member and int(port) == router.fleet_port
        svc = objects[("Service", host)]["spec"]
        assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
        picked = {name for name, labels in pod_labels(objects).items() if selects({"matchLabels": svc["selector"]},
                                                                                   labels)}
        assert picked == {"kvseal-router"}
        (fleet,) = [p for p in svc["ports"] if p["port"] == router.fleet_port]
        (c,) = pod_spec(objects, *ROLES["router"])["containers"]
        assert any(p["name"] == fleet["targetPort"] and p["containerPort"] == router.fleet_port for p in c["ports"])


def test_each_pod_gets_the_allow_list_and_only_its_own_secret_key(
        objects: dict[tuple[str, str], dict[str, Any]]) -> None:
    for role, (kind, name) in ROLES.items():
        spec = pod_spec(objects, kind, name)
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert secrets["fleet-public"].startswith("fleet-public-")
        assert secrets["fleet-secret"].startswith(f"fleet-{role}-")  # the hash suffix: a new key rolls the pods
        assert ("Secret", secrets["fleet-secret"]) in objects
        assert set(objects[("Secret", secrets["fleet-secret"])]["data"]) == {f"{role}.key_secret"}
        assert set(objects[("Secret", secrets["fleet-public"])]["data"]) == {
            "router.key", "prefill.key", "decode.key", "ops.key"}
        # kvseal reads a secret key only at mode 0600 owned by its reader: the init container copies it there
        (init,) = spec["initContainers"]
        assert f"install -m 600 /secret/{role}.key_secret /keys/private/{role}.key_secret" in init["command"][-1]
        private = next(v for v in spec["volumes"] if v["name"] == "fleet-private")
        assert private["emptyDir"]["medium"] == "Memory"  # the key never lands on the node's disk


def _mib(quantity: str) -> float:
    units = {"Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_workers_request_the_memory_their_pool_takes_and_drain_within_their_grace_period(
        objects: dict[tuple[str, str], dict[str, Any]]) -> None:
    for role in ("prefill", "decode"):
        spec = pod_spec(objects, *ROLES[role])
        a = kvseal_args(spec)
        (c,) = spec["containers"]
        pool_mib = a.kv_pool_tokens * KV_BYTES_PER_TOKEN / 2**20
        request = _mib(c["resources"]["requests"]["memory"])
        assert request >= RUNTIME_MIB + pool_mib, (role, request, pool_mib)
        assert _mib(c["resources"]["limits"]["memory"]) > request
        assert spec["terminationGracePeriodSeconds"] > a.drain_timeout
        # preStop starts the drain (SIGTERM to kvseal, pid 1) and returns once the process has exited
        stop = c["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert "kill -TERM 1" in stop and "while kill -0 1" in stop
        assert c["readinessProbe"]["httpGet"]["port"] == "metrics" and a.metrics_port == 9090
    router = pod_spec(objects, *ROLES["router"])
    (c,) = router["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 until the fleet check passed
    assert router["terminationGracePeriodSeconds"] >= 600


def test_only_fleet_members_reach_the_control_kv_and_fleet_ports(
        objects: dict[tuple[str, str], dict[str, Any]]) -> None:
    member = {"podSelector": {"matchLabels": {"kvseal.dev/fleet-member": "true"}}}
    workers = objects[("NetworkPolicy", "kvseal-workers")]["spec"]
    prefill = kvseal_args(pod_spec(objects, *ROLES["prefill"]))
    decode = kvseal_args(pod_spec(objects, *ROLES["decode"]))
    private_ports = {prefill.port, decode.port, decode.kv_port}
    for rule in workers["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if ports & private_ports:
            assert rule["from"] == [member], rule
    assert private_ports <= {p["port"] for rule in workers["ingress"] for p in rule["ports"]}
    router = kvseal_args(pod_spec(objects, *ROLES["router"]))
    rules = objects[("NetworkPolicy", "kvseal-router")]["spec"]["ingress"]
    fleet_rule = next(r for r in rules if {p["port"] for p in r["ports"]} == {router.fleet_port})
    assert fleet_rule["from"] == [member]
    for role, (kind, name) in ROLES.items():  # every pod of the fleet carries the member label
        labels = objects[(kind, name)]["spec"]["template"]["metadata"]["labels"]
        assert labels["kvseal.dev/fleet-member"] == "true", role
    for role in ROLES:  # and a disruption budget per role
        pdb = objects[("PodDisruptionBudget", f"kvseal-{role}")]["spec"]
        assert pdb["selector"]["matchLabels"]["app.kubernetes.io/component"] == role


def test_workers_read_the_metrics_token_from_its_secret_and_probes_do_without_it(objects: Objects,
                                                                                  tmp_path: Path) -> None:
    for role in ("prefill", "decode"):
        spec = pod_spec(objects, *ROLES[role])
        a = kvseal_args(spec)
        secret, key = secret_mount(spec, a.metrics_token_file)
        assert secret.startswith("metrics-token-")  # generated: a new token rolls the workers
        data = objects[("Secret", secret)]["data"]
        assert set(data) == {key}
        mounted = tmp_path / key  # the file the worker reads, as the Secret volume will hold it
        mounted.write_bytes(base64.b64decode(data[key]))
        assert token_sha256(str(mounted)) == hashlib.sha256(METRICS_TOKEN.encode()).hexdigest()
        (c,) = spec["containers"]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):  # the fleet-level view: no header needed
            assert c[probe]["httpGet"]["port"] == "metrics" and "httpHeaders" not in c[probe]["httpGet"]
    router = pod_spec(objects, *ROLES["router"])
    assert not [v for v in router["volumes"] if v.get("secret", {}).get("secretName", "").startswith("metrics-token")]


def test_the_podmonitor_scrapes_every_worker_with_the_token_they_read(rendered: tuple[Objects, Objects]) -> None:
    base, with_prometheus = rendered
    assert not [k for k in base if k[0] in OPERATOR_KINDS]  # deploy/k8s applies on a cluster without the operator
    assert {k for k in with_prometheus if k[0] not in OPERATOR_KINDS} == set(base)
    monitor = with_prometheus[("PodMonitor", "kvseal-workers")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["namespace"] == "kvseal"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    selector = monitor["spec"]["selector"]
    for kind, name in ROLES.values():
        spec = pod_spec(with_prometheus, kind, name)
        labels = with_prometheus[(kind, name)]["spec"]["template"]["metadata"]["labels"]
        picked = (selector["matchLabels"].items() <= labels.items() and all(
            labels.get(e["key"]) in e["values"] for e in selector["matchExpressions"]))
        assert picked == (kind == "StatefulSet"), name  # the workers, not the router (its /metrics: admin keys)
        if not picked:
            continue
        a = kvseal_args(spec)
        (c,) = spec["containers"]
        port = next(p for p in c["ports"] if p["name"] == endpoint["port"])
        assert port["containerPort"] == a.metrics_port and endpoint["path"] == "/metrics"
        # the same Secret (its generated name) and key the worker reads its token from
        assert endpoint["authorization"]["type"] == "Bearer"
        cred = endpoint["authorization"]["credentials"]
        assert (cred["name"], cred["key"]) == secret_mount(spec, a.metrics_token_file)
        assert ("Secret", cred["name"]) in with_prometheus
