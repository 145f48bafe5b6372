#!/usr/bin/env bash
# One-command set-up and run, for a fresh machine:
#   bash tools/quickstart.sh bench [linerate bench options]   # the 4-rank loopback benchmark
#   bash tools/quickstart.sh test  [pytest options]           # the test suite (CI runs this)
# It makes .venv (reusing a system torch if one is there), installs torch==2.13.0 (the CPU
# wheel) and linerate into it, then runs the job.
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-bench}"; shift || true
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
  # Pinned: a looser requirement would download the CUDA build (gigabytes).
  "$VPY" -m pip install -q "torch==2.13.0"
fi
"$VPY" -m pip install -q -e ".[test]"
if [ "$job" = test ] && ! command -v prometheus >/dev/null 2>&1; then
  # The metrics test scrapes a real run with Debian's Prometheus (skipped without it).
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 &&
        apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; } ||
      echo "quickstart: could not install prometheus; its test will be skipped" >&2
  else
    echo "quickstart: prometheus is not installed (needs root and apt-get); its test will be skipped" >&2
  fi
fi
case "$job" in
  bench) exec .venv/bin/linerate bench --nproc 4 --metrics-port 9400 "$@" ;;
  # Two workers: most tests wait on their ranks (timeouts, shaped links), so two share the two
  # cores well; netlab's tests run one at a time (tests/conftest.py's xdist group).
  test)  exec "$VPY" -m pytest -q --durations=25 -n 2 --dist loadgroup "$@" ;;  # the slowest: the CI budget
  *) echo "usage: bash tools/quickstart.sh bench|test [options]" >&2; exit 2 ;;
esac
