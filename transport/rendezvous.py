"""Rendezvous: how the ranks of a group meet through the torch Store before any link exists.

Every key lies under the group's prefix (``linerate/[<scope>/]``)::

    settings                  rank 0's agreement record (JSON): the settings every rank must share
    secret                    rank 0's 32 random bytes (hex): the handshake key of this group;
                              its first 16 hex digits name this incarnation (``generation``)
    offer                     rank 0's shared-memory offer (JSON, ``{}`` if none): published
                              and read with the two above (transport/shm)
    setup_failed/<generation> the first set-up failure any rank reported (text)
    setup_failed/<generation>/read  how many ranks have the failure (a counter: each adds 1
                              once it failed set-up; the rank hosting the Store waits for all)
    transport                 rank 0's LINERATE_TRANSPORT
    rdma/avail/<rank>         [usable, why or ports, number of ports, host] (auto and rdma)
    rdma/decision             rank 0's choice for everyone: ["tcp"|"rdma"|"error", why]
    addr/<rank>               [[address, port], ...]: the TCP listeners, one per rail
    addr/<generation>/count   lazy links: how many ranks published theirs; ``.../all`` once all
    rdma/..., shm/...         what the RDMA links and shared memory exchange (their modules)

``Rendezvous`` wraps the Store: ``get`` polls until the key is there, and gives up at once when
another rank reported a set-up failure (the key it would have set never comes) or at the
deadline, naming the key. Nothing read from the Store is evaluated: values are JSON or text,
checked before use, and a malformed one is an error naming the rank that published it.

``agree_transport`` settles the group's network kind (``tcp`` or ``rdma``); which kind links
each peer is then the link kinds' choice (transport/kinds.py): shared memory for the
co-located peers that proved their host's segment (``transport/shm``, through the same
Rendezvous), the network kind for the others.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time

from .request import TransportError

log = logging.getLogger("linerate.transport")

STORE_PREFIX = "linerate/"
#: Seconds at most that a rank whose process hosts the Store, failing set-up, keeps it
#: answering until every rank has read the failure (``Rendezvous.failure_read``).
HOLD_STORE_S = 3.0


class PeerSetupFailed(TransportError):
    """Another rank of the group failed while the mesh was being built."""


def store_get(store, key: str) -> bytes:
    value = store.get(key)
    return value if isinstance(value, bytes) else bytes(value)


class Rendezvous:
    """The store as mesh set-up uses it. ``get`` polls (``check``: no blocking wait, whose
    timeouts torch logs as warnings) until the key is there, and gives up when a rank of the
    group reported a set-up failure (a key that rank would have set never comes) or at the
    deadline, naming the key. Failures are reported under a key of this generation (rank 0's
    secret), so a failure of an earlier group with the same store prefix is not taken for
    one of this group."""

    def __init__(self, store, rank: int, deadline: float, timeout: float,
                 prefix: str = STORE_PREFIX):
        self._store, self._rank, self.prefix = store, rank, prefix
        self._deadline, self._timeout = deadline, timeout
        self.generation: str | None = None   # known once rank 0's secret is
        self.offered: bytes = b"{}"           # rank 0's offer record (``agree``)
        # A user's Store subclass need not implement check(): without it set-up waits with
        # blocking gets and cannot learn of other ranks' failures early.
        self._can_check = _has_check(store)
        if not self._can_check:
            log.debug("rank %d: the store has no check(): mesh set-up waits with blocking gets",
                      rank)

    @property
    def deadline(self) -> float:
        return self._deadline

    def _check(self, key: str) -> bool | None:
        """Whether the key is set; None if this store cannot say without blocking."""
        return self._check_all([key])

    def _check_all(self, keys: list[str]) -> bool | None:
        """Whether every key is set (one request); None if this store cannot say without
        blocking."""
        if not self._can_check:
            return None
        try:
            return bool(self._store.check(keys))
        except RuntimeError as e:  # torch's DistNetworkError and kin
            raise self.lost(e) from None

    def lost(self, e: BaseException) -> TransportError:
        """The error of a rank whose Store stopped answering during set-up (``e``: what the
        Store raised): the cause lies with the process that hosted it."""
        return TransportError(
            f"rank {self._rank}: the Store stopped answering during group set-up ({e}); the "
            f"process hosting it (MASTER_ADDR:MASTER_PORT, rank 0 unless torchrun's agent "
            f"hosts it) probably exited after failing: its error says why")

    def _fail_key(self) -> str:
        return f"{self.prefix}setup_failed/{self.generation}"

    def set(self, key: str, value) -> None:
        self._store.set(key, value)

    def get(self, key: str, max_delay: float = 0.1) -> bytes:
        """The key's value once it is set (``wait_set``)."""
        self.wait_set(key, max_delay)
        return store_get(self._store, key)

    def wait_set(self, keys, max_delay: float = 0.1, bell=None, pending=None) -> None:
        """Return once every key of ``keys`` (a key or a list) is set. Polls with ``check``
        (one request for all keys), first quickly, then up to ``max_delay`` apart; once the
        first few looks failed, each also asks whether a rank reported a set-up failure.

        ``bell`` and ``pending`` (transport/shm's SetupBoard): co-located ranks post their
        part in shared memory and ring ``bell``, which this rank sleeps on between looks;
        ``pending(keys)`` gives the keys whose part has not come that way. The wait ends when
        none is left, or when the store has the rest (asked only once the first quick looks
        left some: those ranks cannot ring)."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        delay = 0.00025  # a peer a moment behind: first checks come quickly
        waited = 0.0
        while True:
            seen = bell.value() if bell is not None else 0  # read before looking: no lost ring
            left = pending(keys) if pending is not None else keys
            if not left:
                return
            if pending is None or waited >= 0.002:
                have = self._check_all(left)
                if have is None:  # no check(): blocking gets
                    for k in left:
                        store_get(self._store, k)
                    return
                if have:
                    return
            if waited >= 0.002:  # one more round trip per look: not in the first quick ones
                # Named only if a rank did fail: naming asks the store about each key.
                self.raise_if_failed(lambda: f"while waiting for {self._name(left)} in the store")
            if time.monotonic() >= self._deadline:
                raise TransportError(f"rank {self._rank}: {self._name(left)} did not appear in "
                                     f"the store within {self._timeout:.0f}s "
                                     f"(LINERATE_CONNECT_TIMEOUT): a rank of the group has not "
                                     f"got that far; is it running?")
            if bell is not None:
                bell.wait(seen, delay)
            else:
                time.sleep(delay)
            waited += delay
            delay = min(delay * 2, max_delay)

    def _name(self, keys: list[str]) -> str:
        """The keys not set yet, for a message."""
        missing = [k for k in keys if self._check(k) is False] if len(keys) > 1 else keys
        shown = ", ".join(repr(k) for k in (missing or keys)[:4])
        return shown + (f" (and {len(missing) - 4} more)" if len(missing) > 4 else "")

    def raise_if_failed(self, doing) -> None:
        """Raise PeerSetupFailed if a rank of this group reported a set-up failure.
        ``doing``: what this rank was doing, for the message (a string, or a callable that
        makes it: called only when there is a failure to report)."""
        if self.generation is None or not self._check(self._fail_key()):
            return
        why = store_get(self._store, self._fail_key()).decode(errors="replace")
        if callable(doing):
            doing = doing()
        raise PeerSetupFailed(f"rank {self._rank}: another rank failed while the group's "
                              f"connections were being set up ({doing}): {why}")

    def failure_read(self, size: int, hold_s: float = HOLD_STORE_S) -> None:
        """This rank failed set-up, with the group's failure in hand (its own, reported, or
        another rank's, read): it adds 1 to the failure's read counter. A rank whose process
        hosts the Store (rank 0 of a job started by hand or with env://: torch's TCPStore
        server runs in its process) then keeps the Store answering until all ``size`` ranks
        have added theirs, or ``hold_s`` seconds passed: it would otherwise raise and exit
        while the others still poll for the failure, and they would report "the Store stopped
        answering" instead of the cause. Best effort, never raises."""
        if self.generation is None:
            return
        key = self._fail_key() + "/read"
        try:
            read = int(self._store.add(key, 1))
            if read >= size or not hosts_store(self._store, self._rank):
                return
            deadline = time.monotonic() + hold_s
            while read < size and time.monotonic() < deadline:
                time.sleep(0.005)
                read = int(self._store.add(key, 0))
        except Exception:  # noqa: BLE001 - the failure itself is what the caller raises
            return

    def report(self, message: str) -> None:
        """Tell the other ranks (best effort: the store may be what failed)."""
        if self.generation is None:
            return
        try:
            if not self._check(self._fail_key()):  # the first failure is the cause
                self._store.set(self._fail_key(), message[:2000])
        except Exception:  # noqa: BLE001 - reporting must not hide the failure itself
            pass

    # ------------------------------------------------------------------ the group's record
    def agree(self, mine: dict, offer=None) -> bytes:
        """Rank 0 publishes the agreement record and the group's secret; every other rank
        checks its settings against the record (a ValueError naming what differs) and reads
        the secret. Sets ``generation``; returns the secret.

        ``offer`` (rank 0's only): ``offer(secret) -> bytes | None``, a record published in the
        same request (shared memory offers its segment there: transport/shm), which every
        rank then finds in ``offered`` (``b"{}"`` when none): the other ranks read it in the same
        request as the settings, so it costs no wait of its own."""
        pre = self.prefix
        keys = [pre + "settings", pre + "offer", pre + "secret"]
        if self._rank == 0:
            secret = os.urandom(32)
            extra = (offer(secret) if offer is not None else None) or b"{}"
            values = [json.dumps(mine).encode(), extra, secret.hex().encode()]
            multi_set(self._store, keys, values)  # the secret last, where one set per key
            self.offered = extra
        else:
            # Rank 0 may start later than the Store's own timeout (the group's timeout, which
            # may be seconds): wait for its record until LINERATE_CONNECT_TIMEOUT by polling,
            # as every other set-up wait does, then read all three in one request.
            self.wait_set(keys)
            raw_settings, self.offered, raw_secret = multi_get(self._store, keys)
            secret = bytes.fromhex(raw_secret.decode())
        self.generation = secret.hex()[:16]
        if self._rank != 0:
            check_agreement(self._rank, mine, raw_settings)
        return secret

    def publish_addresses(self, addresses: list) -> None:
        """This rank's TCP listeners, [[address, port], ...] one per rail."""
        self.set(f"{self.prefix}addr/{self._rank}", json.dumps(addresses))

    def gather_addresses(self, size: int, nrails: int) -> dict[int, list]:
        """Lazy links: wait until every rank of the group published its listeners (one
        counter: ``addr/count``, and ``addr/all`` set by the last rank), then read them all in
        one request where the Store can (``multi_get``). Returns rank -> [[host, port], ...]
        (this rank's own included). At the deadline, the error names the ranks missing.
        The counter lies under this incarnation's ``generation``."""
        pre = self.prefix
        gen = f"{pre}addr/{self.generation}/"
        last = self._store.add(gen + "count", 1) >= size
        if last:
            self.set(gen + "all", b"1")
        try:
            if not last:
                self.wait_set(gen + "all", max_delay=0.02)  # the group waits on the last rank
        except PeerSetupFailed:
            raise
        except TransportError:
            missing = [r for r in range(size) if self._check(f"{pre}addr/{r}") is False]
            raise TransportError(f"rank {self._rank}: ranks {missing} did not publish their "
                                 f"addresses within {self._timeout:.0f}s "
                                 f"(LINERATE_CONNECT_TIMEOUT): are they running?") from None
        raws = multi_get(self._store, [f"{pre}addr/{r}" for r in range(size)])
        return {r: parse_addresses(raw, r, nrails) for r, raw in enumerate(raws)}

    def addresses_of(self, peer: int, nrails: int) -> list:
        return parse_addresses(self.get(f"{self.prefix}addr/{peer}"), peer, nrails)

    def __getattr__(self, name):  # anything else of the Store
        return getattr(self._store, name)


#: torch's own Stores, whose check() is native: (module, class name).
_NATIVE_STORES = {("torch._C._distributed_c10d", n) for n in ("TCPStore", "FileStore", "HashStore")}
_NATIVE_PREFIX = {("torch._C._distributed_c10d", "PrefixStore"),
                  ("torch.distributed.distributed_c10d", "PrefixStore")}


def store_lost(e: BaseException) -> bool:
    """Whether ``e``, raised by a Store call, says the Store's server went away (the connection
    was reset or closed: torch's DistNetworkError), not that a key or the Store's own timeout
    is at fault."""
    return isinstance(e, ConnectionError) or any(
        c.__name__ == "DistNetworkError" for c in type(e).__mro__)


def _native(store) -> bool:
    """Whether ``store`` is one of torch's own Stores, or PrefixStores over one: their check()
    works, so no probe is needed (a probe is a round trip to the process hosting the store,
    which a small group's set-up waits on: one of its few hand-offs between processes)."""
    for _ in range(16):
        kind = (type(store).__module__, type(store).__qualname__)
        if kind in _NATIVE_STORES:
            return True
        if kind not in _NATIVE_PREFIX:
            return False
        store = getattr(store, "underlying_store", None)
    return False


def _has_check(store) -> bool:
    """Whether ``store.check`` works (torch's Stores: known; others: one probe of a key nobody
    sets)."""
    if _native(store):
        return True
    return _optional(store, "check", [STORE_PREFIX + "probe"]) is not _LACKING


#: What ``_optional`` returns when the Store does not implement the method.
_LACKING = object()


def _optional(store, method: str, *args):
    """``store.<method>(*args)``, or ``_LACKING`` where the Store does not implement it: a
    Python Store without the method (AttributeError, NotImplementedError), or a pybind Store
    subclass without the override, whose RuntimeError says "not implemented" or, for a pure
    virtual method such as ``check`` on torch 2.13, "pure virtual function". Any other
    failure, a RuntimeError of a Store that stopped answering included, is raised."""
    try:
        return getattr(store, method)(*args)
    except (AttributeError, NotImplementedError, RuntimeError) as e:
        text = str(e).lower()
        if isinstance(e, RuntimeError) and not ("not implemented" in text
                                                or "pure virtual" in text):
            raise
        return _LACKING


def _base_store(store):
    """The Store under PrefixStores."""
    for _ in range(16):
        under = getattr(store, "underlying_store", None)
        if under is None:
            break
        store = under
    return store


def hosts_store(store, rank: int = 0) -> bool:
    """Whether this process hosts ``store``'s server: a TCPStore (under PrefixStores) whose
    port this process listens on (/proc: a listening socket of that port among this process's
    descriptors). Where /proc cannot tell, rank 0 is taken for the host (env://)."""
    base = _base_store(store)
    port = getattr(base, "port", None)
    if type(base).__name__ != "TCPStore" or not isinstance(port, int) or port <= 0:
        return False
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        rows = []
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            try:
                with open(table) as f:
                    rows += f.read().splitlines()[1:]
            except OSError:
                continue
        if not inodes or not rows:
            return rank == 0
        for row in rows:
            cols = row.split()
            # local address (hex ip:port), st (0A: LISTEN), inode
            if (len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes
                    and int(cols[1].rsplit(":", 1)[1], 16) == port):
                return True
        return False
    except (OSError, ValueError, IndexError):
        return rank == 0


def multi_get(store, keys: list[str]) -> list[bytes]:
    """The values of ``keys`` in one request where the Store has ``multi_get`` (which waits
    for them all), else one waiting ``get`` per key."""
    values = _optional(store, "multi_get", keys)
    if values is _LACKING:
        return [store_get(store, k) for k in keys]
    return [bytes(v) for v in values]


def multi_set(store, keys: list[str], values: list[bytes]) -> None:
    """``keys`` set in one request where the Store has ``multi_set``, else one ``set`` per
    key, in order (a reader waiting for the last key then finds the others there)."""
    if _optional(store, "multi_set", keys, values) is _LACKING:
        for k, v in zip(keys, values):
            store.set(k, v)


#: The agreement record's entry that names what every rank must run the same of.
VERSION_KEY = "linerate version"


def version_text() -> str:
    """What every rank of a group must run the same of: linerate's version, the wire protocol
    (transport/handshake.py) and the shared segment's layout (transport/shm)."""
    import linerate

    from . import handshake, shm
    return (f"linerate {linerate.__version__} (wire protocol {handshake.VERSION}, "
            f"shared-memory layout {shm.LAYOUT_VERSION})")


def version_mismatch(rank: int, other: int, mine: str, theirs) -> TransportError:
    """The error of ``rank``, which runs ``mine``, in a group where rank ``other`` runs
    ``theirs`` (None: a linerate too old to say)."""
    them = (theirs if isinstance(theirs, str) and theirs else
            "an older linerate, which does not publish its version")
    return TransportError(f"rank {rank}: rank {other} runs {them[:200]}, this rank {mine}: "
                          f"every rank of a group must run the same linerate (install the same "
                          f"torch-linerate version on every host)")


def agreed_settings(options, nrails: int) -> dict:
    """The settings every rank of a group must share, as this rank has them (resolved:
    ``LINERATE_NSOCKS=auto`` counts as the number it means here), and the versions
    (``VERSION_KEY``)."""
    return {VERSION_KEY: version_text(),
            "LINERATE_TRANSPORT": getattr(options, "transport", "tcp"),
            "LINERATE_CHECKSUM": int(options.checksum),
            "LINERATE_TLS": int(options.tls),
            "LINERATE_NSOCKS": options.nsocks,
            "LINERATE_CONNECT": getattr(options, "connect", "eager"),
            "LINERATE_RAIL_SPREAD": getattr(options, "rail_spread", "0"),
            "LINERATE_SOCKET_IFNAME (number of interfaces)": nrails}


def check_agreement(rank: int, mine: dict, raw: bytes) -> None:
    """Compare this rank's shared settings with rank 0's record; a difference is a ValueError
    naming every setting that differs and both values. Different versions (``VERSION_KEY``)
    are a TransportError naming both, checked first."""
    try:
        theirs = json.loads(raw.decode())
        ok = isinstance(theirs, dict)
    except (ValueError, UnicodeDecodeError, RecursionError):
        ok = False
    if not ok:
        raise TransportError(f"rank {rank}: rank 0 published malformed settings in the store: {raw[:200]!r}")
    if VERSION_KEY in mine and theirs.get(VERSION_KEY) != mine[VERSION_KEY]:
        raise version_mismatch(rank, 0, mine[VERSION_KEY], theirs.get(VERSION_KEY))
    differ = [f"{name} is {mine[name]} here but {theirs.get(name, '(not set)')} on rank 0"
              for name in mine if theirs.get(name) != mine[name]]
    if differ:
        raise ValueError(f"rank {rank}: {'; '.join(differ)}: every rank must use the same setting")


def parse_addresses(raw: bytes, peer: int, nrails: int) -> list:
    """A peer's published listen addresses, checked: [[host, port], ...], one per rail."""
    try:
        addrs = json.loads(raw.decode())
        ok = isinstance(addrs, list) and all(
            isinstance(a, list) and len(a) == 2 and isinstance(a[0], str)
            and type(a[1]) is int and 0 < a[1] < 65536  # a TCP port (bool is an int too)
            for a in addrs)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: deep nesting
        ok = False
    if not ok:
        raise TransportError(f"rank {peer} published malformed addresses in the store: {raw[:200]!r}")
    if len(addrs) != nrails:
        raise TransportError(f"rank {peer} listens on {len(addrs)} interfaces, this rank on {nrails}: "
                             f"set LINERATE_SOCKET_IFNAME to the same number of interfaces everywhere")
    return addrs


#: Lines already logged by agree_transport (one line per process, however many groups).
_logged: set = set()


def _log_once(level: int, msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        log.log(level, "%s", msg)


def agree_transport(store, rank: int, size: int, opts, prefix: str, same: bool = False) -> str:
    """Every rank of the group calls this at rendezvous; all return the same "tcp" or "rdma"
    (or all raise). LINERATE_TRANSPORT must be the same everywhere (rank 0's is the one;
    ``same``: the caller checked it already, as ``Rendezvous.agree`` does: a second round
    trip through the store, waiting for rank 0 once more, is saved); for ``auto`` and
    ``rdma`` each rank publishes whether it has an active RDMA port and rank 0 decides for
    everyone."""
    from . import rdma  # pyverbs is looked for only here
    mode = opts.transport
    if not same and rank == 0:
        store.set(prefix + "transport", mode)
    elif not same:
        theirs = store_get(store, prefix + "transport").decode(errors="replace")
        if theirs != mode:
            raise ValueError(f"rank {rank}: LINERATE_TRANSPORT is {mode} here but {theirs} on rank 0: "
                             f"every rank must use the same setting")
    if mode == "tcp":
        return "tcp"
    ok, why, nports = rdma.local_status(opts)
    store.set(f"{prefix}rdma/avail/{rank}", json.dumps([ok, why, nports, socket.gethostname()]))
    if mode == "rdma" and not ok:
        raise TransportError(f"rank {rank}: LINERATE_TRANSPORT=rdma but there is no usable RDMA port "
                             f"here: {why}")
    if rank == 0:
        missing, counts = [], {}
        for r in range(size):
            try:
                ok_r, why_r, n_r, host = json.loads(store_get(store, f"{prefix}rdma/avail/{r}").decode())
            except (ValueError, TypeError):
                ok_r, why_r, n_r, host = False, "published malformed RDMA status", 0, "?"
            if ok_r:
                counts.setdefault(n_r, r)
            else:
                missing.append(f"rank {r} ({host}): {why_r}")
        if missing:
            more = f" (and {len(missing) - 3} more ranks)" if len(missing) > 3 else ""
            decision = ["tcp", "; ".join(missing[:3]) + more]
        elif len(counts) > 1:
            (a, ra), (b, rb) = list(counts.items())[:2]
            decision = ["error", f"rank {ra} uses {a} RDMA ports and rank {rb} {b}: set "
                                 f"LINERATE_RDMA_DEVICE to the same number of ports everywhere"]
        else:
            decision = ["rdma", "every rank has an active RDMA port"]
        store.set(prefix + "rdma/decision", json.dumps(decision))
    decision, why_all = json.loads(store_get(store, prefix + "rdma/decision").decode())
    if decision == "error":
        raise TransportError(f"rank {rank}: {why_all}")
    if decision == "tcp":
        if mode == "rdma":
            raise TransportError(f"rank {rank}: LINERATE_TRANSPORT=rdma, but not every rank can use "
                                 f"RDMA: {why_all}")
        if rank == 0:
            _log_once(logging.WARNING, f"linerate: LINERATE_TRANSPORT=auto: using TCP: {why_all}")
        return "tcp"
    if rank == 0 and mode == "auto":
        _log_once(logging.INFO, f"linerate: LINERATE_TRANSPORT=auto: using RDMA ({why})")
    return "rdma"


__all__ = ["Rendezvous", "PeerSetupFailed", "STORE_PREFIX", "hosts_store", "store_lost",
           "agreed_settings", "check_agreement", "version_text", "version_mismatch", "VERSION_KEY",
           "parse_addresses", "agree_transport", "store_get", "multi_get",
           "multi_set"]
