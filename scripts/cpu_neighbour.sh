#!/usr/bin/env bash
# A CPU-heavy neighbour for "beside load" checks (issues 37, 44): a 2-rank `torsh-dist train` loop, as a
# user's second job would be. Runs until killed (kill the process group: kill -- -PGID).
#   setsid scripts/cpu_neighbour.sh > /tmp/neighbour.log 2>&1 & echo $! > /tmp/neighbour.pid
#   ... run the checks ...; kill -- -"$(cat /tmp/neighbour.pid)"
set -u
py=${PYTHON:-.venv/bin/python}
while true; do
  "$py" -m torsh_distributed.cli.main train --nproc-per-node 2 --preset tiny --max-steps 300 \
    --progress false >/dev/null 2>&1 || sleep 1
done
