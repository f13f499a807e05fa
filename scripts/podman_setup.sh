#!/usr/bin/env bash
# podman as it runs on these machines (cgroup v1, root, no registry): runc instead of crun (crun stops with
# "cgroups in hybrid mode not supported"), the cgroupfs manager, and no default ulimits (the setrlimit calls
# they make are not permitted here). Installs podman, runc, debootstrap and kubectl from Debian when missing.
set -euo pipefail
SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)  # as root: none (apt-get's environment goes through env)
# kubectl renders deploy/k8s (`kubectl kustomize`, tests/unit/test_k8s_manifests.py); Debian's is the client alone
missing=()
for tool in podman runc debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
command -v kubectl >/dev/null || missing+=(kubernetes-client)
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
conf=/etc/containers/containers.conf
if ! grep -q "kvseal" "$conf" 2>/dev/null; then
  $SUDO mkdir -p /etc/containers
  printf '# kvseal (scripts/podman_setup.sh): what podman needs on cgroup v1 without setrlimit\n[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n' \
    | $SUDO tee "$conf" >/dev/null
fi
