#!/usr/bin/env bash
# A CPU-heavy neighbour for "beside load" checks (issues 37, 44): a 2-rank `torsh-dist train` loop, as a
# user's second job would be. Runs until killed (kill the process group: kill -- -PGID).
#   setsid scripts/cpu_neighbour.sh > /tmp/neighbour.log 2>&1 &
#   ... run the checks ...; kill -- -PGID  (find it: ps -eo pid,pgid,cmd | grep cpu_neighbour; setsid may
#   fork, so $! is not always the group)
# It runs from this checkout's root (its .venv), wherever it is started from; a failing run is
# reported on stderr, not hidden.
set -u
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
while true; do
  "$py" -m torsh_distributed.cli.main train --nproc-per-node 2 --preset tiny --max-steps 300 \
    --progress false >/dev/null 2>/tmp/cpu_neighbour.err || { tail -3 /tmp/cpu_neighbour.err >&2; sleep 1; }
done
