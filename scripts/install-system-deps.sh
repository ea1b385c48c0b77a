#!/usr/bin/env bash
# Installs the Debian packages the integration tests need, only if missing.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
# monitoring integration tests (issue 6): a real Prometheus server and a headless browser
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
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
