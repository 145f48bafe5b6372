#!/usr/bin/env bash
# Runs inside the linerate-rdma image (docker/rdma/run.sh starts it): device checks, then the
# transport conformance tests with their "rdma" cases on the host's soft-RoCE device.
set -uo pipefail
cd /opt/linerate
echo "== ibv_devices"; ibv_devices || true
echo "== ibv_devinfo"; ibv_devinfo || true
echo "== locked memory: $(ulimit -l)"
echo "== linerate probe"; linerate probe
# A verbs-level ping-pong between two processes here (no linerate): if this fails, the
# device or the container's access to it is the problem, not linerate.
dev=$(ibv_devices 2>/dev/null | awk 'NR>2 {print $1; exit}')
if [ -n "${dev:-}" ]; then
  gid=$(linerate probe --json | python -c 'import json,sys; r=json.load(sys.stdin)["rdma"]; print(next((g["index"] for p in r["ports"] for g in p["gids"] if g["chosen"]), 0))')
  echo "== ibv_rc_pingpong on $dev (GID index $gid)"
  ibv_rc_pingpong -d "$dev" -g "$gid" -n 100 >/tmp/pp-server.txt 2>&1 &
  sleep 1
  ibv_rc_pingpong -d "$dev" -g "$gid" -n 100 127.0.0.1 && wait || echo "ibv_rc_pingpong FAILED (see above)"
  cat /tmp/pp-server.txt
fi
echo "== tests (the rdma cases use ${dev:-no device})"
python -m pytest -q -rs tests/test_transport.py tests/test_rdma.py "$@"
