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
if [ "$job" = test ]; then
  # The frameworks whose recipes the tests run (Lightning, Accelerate, Transformers), with the
  # torch pin in the same command so that pip cannot swap the CPU wheel (pyproject.toml).
  "$VPY" -m pip install -q -e ".[test,frameworks]" "torch==2.13.0"
else
  "$VPY" -m pip install -q -e ".[test]"
fi
# The sources compiled once (what pip does for an installed package, and an editable install
# does not): where PYTHONDONTWRITEBYTECODE is set, every rank process the benchmark or the
# suite starts would compile linerate from source again (about 0.25 s of CPU each).
# shellcheck disable=SC2046
"$VPY" -m compileall -q -j 0 $(for d in linerate collectives transport tools tests; do
  if [ -d "$d" ]; then echo "$d"; fi; done) >/dev/null
# The packages of what the suite's real checks use, where this machine lacks it: Prometheus
# (scrapes a real run), tcpdump (TLS on the wire), iperf3 (the link probe), ping and iproute2
# (netlab), rdma-core's pyverbs (the fake pyverbs is held against it; no RDMA device needed),
# docker-compose (validates docker/compose.yaml; no container engine needed).
# A test whose tool is missing is skipped, and tests/conftest.py fails the run on such a skip
# (not on python3-pyverbs where the platform has no such package).
absent() {
  command -v prometheus >/dev/null 2>&1 || echo prometheus
  command -v tcpdump >/dev/null 2>&1 || echo tcpdump
  command -v iperf3 >/dev/null 2>&1 || echo iperf3
  command -v ping >/dev/null 2>&1 || echo iputils-ping
  { command -v ip && command -v tc; } >/dev/null 2>&1 || echo iproute2
  [ -d /usr/lib/python3/dist-packages/pyverbs ] || echo python3-pyverbs
  { command -v docker-compose || { command -v docker && docker compose version; }; } \
    >/dev/null 2>&1 || echo docker-compose
}
if [ "$job" = test ] && [ -n "$(absent)" ]; then
  how="installing needs root and apt-get"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    how="apt-get could not install it"
    export DEBIAN_FRONTEND=noninteractive
    apt_install() { apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1; }
    # One call; if it fails (a fresh machine's empty package lists, or a package that this
    # platform does not have, such as python3-pyverbs), update the lists and install what
    # the platform has.
    # shellcheck disable=SC2046
    apt_install $(absent) ||
      { apt-get update -qq >/dev/null 2>&1
        apt_install $(for p in $(absent); do apt-cache show "$p" >/dev/null 2>&1 && echo "$p"; done); } ||
      true
  fi
  if [ -n "$(absent)" ]; then
    echo "quickstart: not installed: $(absent | xargs) ($how); the tests that use it are" \
         "skipped, and the run's end lists the skips" >&2
  fi
fi
case "$job" in
  bench) exec .venv/bin/linerate bench --nproc 4 --metrics-port 9400 "$@" ;;
  # Two workers: most tests wait on their ranks (timeouts, shaped links), so two share the two
  # cores well; netlab's tests run one at a time (tests/conftest.py's xdist group).
  test)  exec "$VPY" -m pytest -q --durations=25 -n 2 --dist loadgroup "$@" ;;  # the slowest: the CI budget
  *) echo "usage: bash tools/quickstart.sh bench|test [options]" >&2; exit 2 ;;
esac
