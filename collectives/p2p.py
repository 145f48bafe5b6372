"""Point-to-point: send, recv and recv from any source go straight to the transport and
progress on their own, beside the group's collectives."""
from __future__ import annotations

from linerate.transport import CHANNEL_P2P

from .comm import byte_view
from .stage import Stage
from .validate import desc
from .work import Work, complete


class PointToPoint:
    """The point-to-point methods of the process group (``_ctx``, ``_rank``, ``_timeout``,
    ``_validate``: validate.CHECKS)."""

    def _p2p_work(self, desc: str, result: list, stage: Stage, req) -> Work:
        work = Work(desc, result, stage.devices, timeout=self._timeout)

        def done(r):
            if r.error is None:
                try:
                    stage.finish()
                except BaseException as e:  # noqa: BLE001 - reported through the Work
                    complete(work, e, r.peer if r.peer is not None else -1)
                    return
            complete(work, r.error, r.peer if r.peer is not None else -1)

        req.add_done_callback(done)
        return work

    def send(self, tensors, dst: int, tag: int = 0):
        self._validate("send", tensors=tensors, peer=dst, tag=tag)
        t = tensors[0]
        stage = Stage(self._rank)
        buf = stage.inp(t)
        req = self._ctx.isend(dst, byte_view(buf), CHANNEL_P2P, tag, 0, f"send to rank {dst} tag {tag}")
        return self._p2p_work(f"send to rank {dst} (tag {tag}, {desc(t)})", list(tensors), stage, req)

    def recv(self, tensors, src: int, tag: int = 0):
        self._validate("recv", tensors=tensors, peer=src, tag=tag)
        t = tensors[0]
        stage = Stage(self._rank)
        buf = stage.out(t)
        req = self._ctx.irecv(src, byte_view(buf), CHANNEL_P2P, tag, 0, f"recv from rank {src} tag {tag}")
        return self._p2p_work(f"recv from rank {src} (tag {tag}, {desc(t)})", list(tensors), stage, req)

    def recv_anysource(self, tensors, tag: int = 0):
        self._validate("recv", tensors=tensors, peer=None, tag=tag)
        t = tensors[0]
        stage = Stage(self._rank)
        buf = stage.out(t)
        req = self._ctx.irecv(None, byte_view(buf), CHANNEL_P2P, tag, 0, f"recv from any rank tag {tag}")
        return self._p2p_work(f"recv from any rank (tag {tag}, {desc(t)})", list(tensors), stage, req)
