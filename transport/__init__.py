"""linerate transport: moves bytes between the ranks of a group over links (striped TCP
connections, RDMA queue pairs, or shared memory between the ranks of one host).

It knows nothing of torch.distributed's ProcessGroup nor of any algorithm: a Context is built
from a key-value store (rendezvous.py), a rank and a size, and offers isend/irecv on
memoryviews; matching.py pairs messages with receives, link.py specifies the links (tcp.py,
rdma.py, shm/ring.py: shared memory to co-located ranks, in the shm/ package's segment), and ``Context.stats()`` is the snapshot its users and the metrics read.
"""
import importlib

from .framing import CHANNEL_COLLECTIVE, CHANNEL_P2P
from .options import TransportOptions, parse_size
from .request import MismatchError, PeerFailure, Request, TransportError


def __getattr__(name: str):
    # Context and metrics import torch (shared memory maps tensors): loaded on first use, so
    # that what needs only the options (the ``linerate`` command's launchers and argument
    # types) starts without it.
    if name == "Context":
        from .context import Context as value
    elif name == "metrics":
        # (import_module: ``from . import metrics`` would ask this function again)
        value = importlib.import_module(".metrics", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = ["Context", "TransportOptions", "Request", "TransportError", "PeerFailure",
           "MismatchError", "CHANNEL_COLLECTIVE", "CHANNEL_P2P", "parse_size", "metrics"]
