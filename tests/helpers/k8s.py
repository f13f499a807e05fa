"""deploy/k8s rendered offline, for the manifests' tests: `kubectl kustomize` over a copy of the folder with a fresh
key set and the other files its secretGenerator reads (never committed), every object validated in strict mode
against the Kubernetes 1.30 API schemas, and the helpers that read the rendered objects the way Kubernetes does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from kvseal.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
METRICS_TOKEN = "0123456789abcdef0123456789abcdef"  # what `openssl rand -hex 16` would write
STATE_PASSWORD = "5ea1ed5ea1ed" * 5 + "beef"  # what `openssl rand -hex 32` would write
STATE_SECRET = "c0ffee" * 10 + "cafe"
GENERATED = ("fleet-keys", "api-keys", "metrics-token", "state-password", "state-secret")  # deploy/k8s/.gitignore
OPERATOR_KINDS = {"PodMonitor"}  # the Prometheus operator's CRDs: no schema in kubernetes-validate
ROLES = {"prefill": ("StatefulSet", "kvseal-prefill"), "decode": ("StatefulSet", "kvseal-decode"),
         "router": ("Deployment", "kvseal-router")}

Objects = dict[tuple[str, str], dict[str, Any]]


def render(folder: Path) -> Objects:
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for d in docs:
        if d["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(d, "1.30.0", strict=True)  # raises ValidationError naming the field
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def render_fresh(deploy: Path) -> tuple[Objects, Objects]:
    """(deploy/k8s, deploy/prometheus) copied under `deploy` and rendered with a fresh key set, API keys, metrics
    token, Redis password and state secret, made as kustomization.yaml's header says."""
    assert shutil.which("kubectl"), "kubectl is missing: the repo's setup installs it (scripts/podman_setup.sh)"
    k8s = deploy / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", k8s, ignore=shutil.ignore_patterns(*GENERATED))
    shutil.copytree(ROOT / "deploy" / "prometheus", deploy / "prometheus")
    subprocess.run([sys.executable, "-m", "kvseal", "keys", str(k8s / "fleet-keys"), "router", "prefill", "decode",
                    "ops"], check=True, capture_output=True, timeout=60)
    (k8s / "api-keys").write_text("alice sk-alice-0001\nops sk-ops-0002 admin\n")
    (k8s / "metrics-token").write_text(METRICS_TOKEN + "\n")
    (k8s / "state-password").write_text(STATE_PASSWORD + "\n")
    (k8s / "state-secret").write_text(STATE_SECRET + "\n")
    return render(k8s), render(deploy / "prometheus")


def pod_spec(objects: Objects, kind: str, name: str) -> dict[str, Any]:
    return objects[(kind, name)]["spec"]["template"]["spec"]


def kvseal_args(spec: dict[str, Any]) -> Any:
    (c,) = spec["containers"]
    args = [a.replace("$(POD_NAME)", "kvseal-x-0") for a in c["args"]]
    return build_parser().parse_args(args)


def pod_labels(objects: Objects) -> dict[str, dict[str, str]]:
    """Every pod template's labels, by its workload's name."""
    return {name: o["spec"]["template"]["metadata"]["labels"] for (kind, name), o in objects.items()
            if kind in ("Deployment", "StatefulSet")}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions, as Kubernetes reads them) selects `labels`."""
    ops = {"In": lambda k, v: labels.get(k) in v, "NotIn": lambda k, v: labels.get(k) not in v,
           "Exists": lambda k, v: k in labels, "DoesNotExist": lambda k, v: k not in labels}
    return (selector.get("matchLabels", {}).items() <= labels.items()
            and all(ops[e["operator"]](e["key"], e.get("values")) for e in selector.get("matchExpressions", [])))


def secret_mount(spec: dict[str, Any], path: str) -> tuple[str, str]:
    """(the Secret, the key in it) that `path` in the container of `spec` reads."""
    (c,) = spec["containers"]
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    return volume["secret"]["secretName"], path.removeprefix(mount["mountPath"].rstrip("/") + "/")
