#!/usr/bin/env bash
# Run linerate's transport conformance tests over soft-RoCE on this host:
#   sudo bash docker/rdma/run.sh [NETDEV] [pytest options]
# Needs a kernel with the rdma_rxe module (most distribution kernels have it), iproute2's
# `rdma` tool and Docker. It loads rdma_rxe, adds an rxe device on NETDEV (default: the
# interface of the default route) unless one exists, builds the image and runs the tests in
# it with the host's network, /dev/infiniband and unlimited locked memory.
set -euo pipefail
cd "$(dirname "$0")/../.."
netdev="${1:-$(ip route show default | awk '{print $5; exit}')}"
[ $# -gt 0 ] && shift
if ! ls /sys/class/infiniband 2>/dev/null | grep -q .; then
  modprobe rdma_rxe
  rdma link add rxe0 type rxe netdev "$netdev"
  echo "added soft-RoCE device rxe0 on $netdev"
fi
rdma link show
docker build -f docker/rdma/Dockerfile -t linerate-rdma .
exec docker run --rm --network host --privileged --device /dev/infiniband \
  --ulimit memlock=-1:-1 linerate-rdma bash docker/rdma/in_container.sh "$@"
