#!/bin/bash
# CPU seconds (cgroup v1 cpuacct: the command and every process under it) and wall time of a
# 4-client, 1-round `torsh-dist federated`, BEFORE (an older tree's src on PYTHONPATH) and the
# installed tree alternating. Root and cgroup v1 cpuacct needed. docs/benchmarks.md, "Warm ClientApps".
#   mkdir -p /tmp/before && git archive <commit> src | tar -x -C /tmp/before
#   bash benchmarks/fed_cpu_pair.sh /tmp/before/src [PAIRS]
set -eu
BEFORE_SRC=$1
PAIRS=${2:-2}
TORSH_DIST=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/torsh-dist
cpu_of() {  # cpu_of CMD...: runs CMD in a fresh cgroup, prints its CPU seconds
  local g=/sys/fs/cgroup/cpuacct/fedpair-$$
  mkdir -p "$g"
  bash -c "echo \$\$ > $g/cgroup.procs; exec \"\$@\"" _ "$@" > /dev/null 2>&1
  sleep 0.5
  awk '{printf "%.2f", $1/1e9}' "$g/cpuacct.usage"
  rmdir "$g" 2>/dev/null || true
}
for _ in $(seq "$PAIRS"); do
  for variant in before after; do
    run=$(mktemp -d)
    start=$(date +%s.%N)
    if [ "$variant" = before ]; then
      cpu=$(PYTHONPATH=$BEFORE_SRC cpu_of "$TORSH_DIST" federated --clients 4 --rounds 1 --run-dir "$run")
    else
      cpu=$(cpu_of "$TORSH_DIST" federated --clients 4 --rounds 1 --run-dir "$run")
    fi
    end=$(date +%s.%N)
    echo "$variant cpu_s=$cpu wall_s=$(echo "$end - $start - 0.5" | bc) load=$(cut -d' ' -f1 /proc/loadavg)"
    rm -rf "$run"
  done
done
