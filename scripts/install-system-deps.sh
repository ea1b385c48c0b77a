#!/usr/bin/env bash
# Installs the Debian packages the integration tests need, only if missing.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
# monitoring integration tests (issue 6): a real Prometheus server and a headless browser
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
# cluster launchers (issue 17): a single-host SLURM cluster (munge auth) and Open MPI (+ headers for mpi4py)
command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
command -v srun >/dev/null 2>&1 || missing+=(slurm-client)
command -v munged >/dev/null 2>&1 || missing+=(munge)
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
# federated over TLS (issue 43): a capture on the lab's link shows no plaintext
command -v tcpdump >/dev/null 2>&1 || missing+=(tcpdump)
[ -e /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -n "$(find /usr/lib/*/openmpi/include -name mpi.h 2>/dev/null | head -1)" ] || missing+=(libopenmpi-dev)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "note: ${missing[*]} not installed and cannot install (need root + apt-get); those tests will be skipped" >&2
  exit 0
fi
echo "installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
