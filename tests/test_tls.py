"""LINERATE_TLS: TLS 1.3 with mutual authentication on every TCP
connection (transport/tls.py).

- A throwaway CA and per-rank certificates are made here (the ``cryptography`` package, else
  the ``openssl`` command; skipped with the reason where neither exists).
- 2 and 3 ranks over TLS (LINERATE_SHM=0: loopback ranks would share memory): all_reduce,
  broadcast and send/recv give NumPy's results on the same inputs; every connection is TLS 1.3.
- A rank whose certificate comes from another CA (or that trusts another CA) is refused, and
  every rank fails naming the certificate problem well within LINERATE_CONNECT_TIMEOUT.
- TLS on one rank and off on another, a missing key file, TLS with the RDMA transport: every
  rank fails naming the setting (and the file).
- The stream itself: both directions at once from two threads (OpenSSL forbids concurrent
  SSL_read/SSL_write on one SSL object; TlsStream serializes them), file problems named.
- On netlab (skipped with the reason without it or tcpdump): a capture on the host's
  interface shows a known pattern of a broadcast / all_reduce without TLS, and never with it.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from _harness import run_rank_scripts
from linerate.transport import tls

ROOT = Path(__file__).resolve().parent.parent
PROBE = b"LINERATE-TLS-PROBE"


# ----------------------------------------------------------------------------- certificates
def _cryptography():
    try:
        from cryptography import x509  # noqa: F401
        return True
    except ImportError:
        return False


def _cert_reason() -> str | None:
    if _cryptography() or shutil.which("openssl"):
        return None
    return "neither the cryptography package nor the openssl command is installed"


class _CA:
    """A throwaway CA that signs leaf certificates (files in ``folder``)."""

    def __init__(self, folder: Path, name: str):
        self.folder, self.name = folder, name
        folder.mkdir(parents=True, exist_ok=True)
        self.cert = folder / f"{name}.pem"
        self.key = folder / f"{name}.key"
        if _cryptography():
            self._make_ca_py()
        else:
            _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                     "-nodes", "-keyout", self.key, "-out", self.cert, "-days", "2",
                     "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
                     "-addext", "keyUsage=critical,keyCertSign,cRLSign")

    def _make_ca_py(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                               critical=False)
                .sign(key, hashes.SHA256()))
        self._key_obj, self._cert_obj = key, cert
        self.key.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        self.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str) -> tuple[Path, Path]:
        """(certificate, key) of a leaf for both TLS roles."""
        cert, key = self.folder / f"{name}.pem", self.folder / f"{name}.key"
        if _cryptography():
            from cryptography import x509
            from cryptography.hazmat.primitives import hashes, serialization
            from cryptography.hazmat.primitives.asymmetric import ec
            from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
            k = ec.generate_private_key(ec.SECP256R1())
            now = datetime.datetime.now(datetime.timezone.utc)
            c = (x509.CertificateBuilder()
                 .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                 .issuer_name(self._cert_obj.subject).public_key(k.public_key())
                 .serial_number(x509.random_serial_number())
                 .not_valid_before(now - datetime.timedelta(hours=1))
                 .not_valid_after(now + datetime.timedelta(days=2))
                 .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                 .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                       ExtendedKeyUsageOID.CLIENT_AUTH]),
                                critical=False)
                 .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                     self._key_obj.public_key()), critical=False)
                 .sign(self._key_obj, hashes.SHA256()))
            key.write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
            cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
        else:
            csr, ext = self.folder / f"{name}.csr", self.folder / f"{name}.ext"
            ext.write_text("basicConstraints=critical,CA:FALSE\n"
                           "extendedKeyUsage=serverAuth,clientAuth\n")
            _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                     "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
            _openssl("x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key,
                     "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext)
        os.chmod(key, 0o600)
        return cert, key


def _openssl(*argv) -> None:
    subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The job's CA with rank0..rank3 certificates, and a foreign CA with one of its own."""
    reason = _cert_reason()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("pki")
    ca, other = _CA(d, "job-ca"), _CA(d, "other-ca")
    out = {"dir": d, "ca": ca.cert, "other_ca": other.cert}
    for r in range(4):
        out[f"rank{r}"] = ca.issue(f"rank{r}")
    out["foreign"] = other.issue("foreign")
    return out


def tls_env(pki, rank: int, ca=None, cert=None) -> dict:
    c, k = cert or pki[f"rank{rank}"]
    return {"LINERATE_TLS": "1", "LINERATE_TLS_CERT": str(c), "LINERATE_TLS_KEY": str(k),
            "LINERATE_TLS_CA": str(ca or pki["ca"])}


# ----------------------------------------------------------------------------- ranks
_SCRIPT = r"""
import datetime, json, os, sys, time
import numpy as np, torch, torch.distributed as dist
import linerate
RANK, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
t0 = time.monotonic()
try:
    # The Store is the test's (as torchrun's agent hosts it): a rank that fails and exits
    # must not take the Store that the others read its report from with it.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), W,
                          is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("linerate", store=store, rank=RANK, world_size=W,
                            timeout=datetime.timedelta(seconds=60))
except Exception as e:
    print("SETUP-FAILED %.2f %s: %s" % (time.monotonic() - t0, type(e).__name__,
                                        str(e).replace("\n", " ")), flush=True)
    sys.stdout.flush()
    os._exit(3)
ctx = dist.group.WORLD._get_backend(torch.device("cpu"))._ctx
info = {"shm": ctx.shm is not None}

def data(r, n, salt):
    rng = np.random.default_rng(1000 * salt + r)
    return rng.integers(-1000, 1000, n).astype(np.float32)

ok = []
for i, n in enumerate((1, 1000, 3_000_000)):          # all_reduce, sizes over many chunks
    t = torch.from_numpy(data(RANK, n, i))
    dist.all_reduce(t)
    want = sum(data(r, n, i).astype(np.float64) for r in range(W))
    ok.append(bool(np.array_equal(t.numpy(), want.astype(np.float32))))
t = torch.from_numpy(data(RANK, 1000, 7).astype(np.int64))
dist.all_reduce(t, op=dist.ReduceOp.MAX)
ok.append(bool(np.array_equal(t.numpy(), np.max([data(r, 1000, 7) for r in range(W)], 0))))
root = W - 1                                          # broadcast
t = torch.from_numpy(data(RANK, 2_000_000, 9))
dist.broadcast(t, root)
ok.append(bool(np.array_equal(t.numpy(), data(root, 2_000_000, 9))))
n = 1_500_000                                         # send/recv around a ring
src, dst = (RANK - 1) % W, (RANK + 1) % W
out, got = torch.from_numpy(data(RANK, n, 11)), torch.empty(n)
reqs = [dist.isend(out, dst), dist.irecv(got, src)]
for q in reqs:
    q.wait()
ok.append(bool(np.array_equal(got.numpy(), data(src, n, 11))))
info["ok"] = ok
# after the traffic: links are made on first use (LINERATE_CONNECT=lazy)
conns = [c for p in ctx.stats()["peers"] for link in p["links"] for c in link["connections"]]
info["streams"] = sorted({("TlsStream:" + c["tls"]) if c["tls"] else "socket:plain"
                          for c in conns})
print("RESULT " + json.dumps(info), flush=True)
dist.destroy_process_group()
"""


def run_script(tmp_path: Path, world: int, timeout: float, env: dict | None = None,
               per_rank_env: dict | None = None, script: str = _SCRIPT):
    """Run ``script`` as ``world`` rank processes around a Store hosted here (as torchrun's
    agent hosts it: a rank that fails cannot take the Store with it)."""
    return run_rank_scripts(tmp_path, script, world, timeout,
                            {"LINERATE_SHM": "0", "LINERATE_CONNECT_TIMEOUT": "30", **(env or {})},
                            per_rank_env, host_store=True)


def _failure(text: str) -> tuple[float, str]:
    line = next((ln for ln in text.splitlines() if ln.startswith("SETUP-FAILED")), None)
    assert line is not None, text[-3000:]
    _, seconds, msg = line.split(" ", 2)
    return float(seconds), msg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_collectives_over_tls_match_numpy(tmp_path, pki, world):
    res = run_script(tmp_path, world, 100, per_rank_env={r: tls_env(pki, r) for r in range(world)})
    for r, (code, text) in enumerate(res):
        assert code == 0, f"rank {r}:\n{text[-3000:]}"
        info = json.loads(text.split("RESULT ", 1)[1].splitlines()[0])
        assert info["streams"] == ["TlsStream:TLSv1.3"], info   # every connection is TLS 1.3
        assert not info["shm"]
        assert all(info["ok"]), (r, info)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["cert from another CA", "trusts another CA"])
@pytest.mark.parametrize("world", [2, 3])
def test_foreign_certificate_fails_every_rank_naming_it(tmp_path, pki, how, world):
    bad = world - 1
    per = {r: tls_env(pki, r) for r in range(world)}
    if how == "cert from another CA":
        per[bad] = tls_env(pki, bad, cert=pki["foreign"])
    else:  # its own certificate and CA are of the other CA: it refuses the others
        per[bad] = tls_env(pki, bad, cert=pki["foreign"], ca=pki["other_ca"])
    # Links made at creation, so that group creation is what fails (lazy links, the default,
    # fail the first operation that needs the link instead, naming the peer as well).
    res = run_script(tmp_path, world, 80, env={"LINERATE_CONNECT": "eager"}, per_rank_env=per)
    for r, (code, text) in enumerate(res):
        assert code == 3, f"rank {r} exited {code}:\n{text[-3000:]}"
        seconds, msg = _failure(text)
        assert seconds < 20, (r, seconds, msg)             # LINERATE_CONNECT_TIMEOUT is 30
        assert "certificate" in msg and "LINERATE_TLS_CA" in msg, (r, msg)
        if r != bad:
            assert f"rank {bad}" in msg, (r, msg)


@pytest.mark.timeout(60)
def test_tls_on_one_rank_only_is_named_on_every_rank(tmp_path, pki):
    for off in (0, 1):
        per = {r: tls_env(pki, r) for r in range(2)}
        per[off] = {"LINERATE_TLS": "0"}
        res = run_script(tmp_path, 2, 50, per_rank_env=per)
        for r, (code, text) in enumerate(res):
            assert code == 3, f"rank {r} exited {code}:\n{text[-3000:]}"
            seconds, msg = _failure(text)
            assert "LINERATE_TLS is" in msg and seconds < 10, (off, r, msg)


@pytest.mark.timeout(60)
def test_missing_key_file_is_named_on_every_rank(tmp_path, pki):
    per = {r: tls_env(pki, r) for r in range(2)}
    per[1]["LINERATE_TLS_KEY"] = str(tmp_path / "no-such.key")
    res = run_script(tmp_path, 2, 50, per_rank_env=per)
    for r, (code, text) in enumerate(res):
        assert code == 3, f"rank {r} exited {code}:\n{text[-3000:]}"
        seconds, msg = _failure(text)
        assert "LINERATE_TLS_KEY" in msg and "no-such.key" in msg and seconds < 10, (r, msg)
        assert "No such file" in msg, msg


@pytest.mark.timeout(60)
def test_tls_with_rdma_is_refused(tmp_path, pki):
    per = {r: dict(tls_env(pki, r), LINERATE_TRANSPORT="rdma") for r in range(2)}
    res = run_script(tmp_path, 2, 50, per_rank_env=per)
    for r, (code, text) in enumerate(res):
        assert code == 3, f"rank {r} exited {code}:\n{text[-3000:]}"
        _, msg = _failure(text)
        assert "LINERATE_TLS=1 with LINERATE_TRANSPORT=rdma" in msg, msg


# ----------------------------------------------------------------------------- in-process
def _pair(pki, client_ca=None, client_cert=None):
    """(client stream, server stream) over a socketpair, or the exceptions raised."""
    server_cfg = tls.load(True, *map(str, pki["rank0"]), str(pki["ca"]))
    c_cert, c_key = client_cert or pki["rank1"]
    client_cfg = tls.load(True, str(c_cert), str(c_key), str(client_ca or pki["ca"]))
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(10)
    out = {}

    def serve():
        try:
            out["server"] = server_cfg.wrap(b, True, "the client")
        except Exception as e:  # noqa: BLE001
            out["server"] = e

    t = threading.Thread(target=serve)
    t.start()
    try:
        client = client_cfg.wrap(a, False, "rank 0")
        client.sendall(b"ping")   # TLS 1.3: a refused client learns it on its first read
        buf = bytearray(4)
        t.join()
        if not isinstance(out["server"], Exception):
            out["server"].recv_into(buf, 4, socket.MSG_WAITALL)
            out["server"].sendall(b"pong")
        client.recv_into(buf, 4, socket.MSG_WAITALL)
    except Exception as e:  # noqa: BLE001
        client = e
    t.join()
    return client, out["server"]


def test_stream_both_directions_at_once(pki):
    """Each end sends 24 MB (frames of sendmsg'd header + chunk, and small sendall's) from one
    thread while another receives: what arrives is what was sent, byte for byte."""
    client, server = _pair(pki)
    assert client.version == "TLSv1.3" and server.version == "TLSv1.3"
    rng = np.random.default_rng(5)
    blobs = {s: rng.integers(0, 256, 24 << 20, dtype=np.uint8) for s in ("c", "s")}
    got = {s: np.zeros(24 << 20, np.uint8) for s in ("c", "s")}
    errors = []

    def send(stream, data):
        try:
            mv = memoryview(data)
            off, k = 0, 0
            while off < len(data):
                n = min(len(data) - off, (1 << 20) if k % 3 else 1000)
                hdr = n.to_bytes(48, "little")
                assert stream.sendmsg((hdr, mv[off:off + n])) == 48 + n
                off += n
                k += 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def recv(stream, into):
        try:
            view, off, hdr = memoryview(into), 0, bytearray(48)
            while off < len(into):
                assert stream.recv_into(hdr, 48, socket.MSG_WAITALL) == 48
                n = int.from_bytes(hdr, "little")
                assert stream.recv_into(view[off:off + n], n, socket.MSG_WAITALL) == n
                off += n
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    for s in (client, server):
        s.settimeout(None)
    threads = [threading.Thread(target=send, args=(client, blobs["c"])),
               threading.Thread(target=send, args=(server, blobs["s"])),
               threading.Thread(target=recv, args=(server, got["c"])),
               threading.Thread(target=recv, args=(client, got["s"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert np.array_equal(got["c"], blobs["c"]) and np.array_equal(got["s"], blobs["s"])
    client.close()
    server.close()


def test_refused_certificates_are_explained(pki):
    client, server = _pair(pki, client_cert=pki["foreign"])
    assert isinstance(client, OSError) and "refused this rank's certificate" in str(client), client
    assert isinstance(server, tls.TlsError) and "not trusted" in str(server), server
    client, server = _pair(pki, client_cert=pki["foreign"], client_ca=pki["other_ca"])
    assert isinstance(client, tls.TlsError) and "rank 0's certificate is not trusted" in str(client)


def test_plain_peer_is_named(pki):
    cfg = tls.load(True, *map(str, pki["rank0"]), str(pki["ca"]))
    a, b = socket.socketpair()
    a.settimeout(5)
    b.sendall(b"LNRT" + bytes(60))  # linerate's plain handshake where TLS was expected
    with pytest.raises(tls.TlsError, match="does not speak TLS"):
        cfg.wrap(a, True, "the connection from 1.2.3.4:5")
    a.close()
    b.close()


def test_file_problems_name_the_variable(pki, tmp_path):
    cert, key = map(str, pki["rank0"])
    ca = str(pki["ca"])
    with pytest.raises(ValueError, match="LINERATE_TLS_KEY is not set"):
        tls.load(True, cert, "", ca)
    with pytest.raises(ValueError, match=r"LINERATE_TLS_KEY='/nope/k.pem': cannot read .*No such file"):
        tls.load(True, cert, "/nope/k.pem", ca)
    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    with pytest.raises(ValueError, match="LINERATE_TLS_CA=.*no PEM certificate"):
        tls.load(True, cert, key, str(junk))
    with pytest.raises(ValueError, match="LINERATE_TLS_CERT=.*no PEM certificate"):
        tls.load(True, str(junk), key, ca)
    with pytest.raises(ValueError, match=r"LINERATE_TLS_KEY=.* is not the private key of LINERATE_TLS_CERT"):
        tls.load(True, cert, str(pki["rank1"][1]), ca)
    if _cryptography():
        from cryptography.hazmat.primitives import serialization
        k = serialization.load_pem_private_key(Path(key).read_bytes(), None)
        enc = tmp_path / "enc.key"
        enc.write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.BestAvailableEncryption(b"pw")))
        with pytest.raises(ValueError, match="LINERATE_TLS_KEY=.*encrypted"):
            tls.load(True, cert, str(enc), ca)
    assert tls.load(False, "", "", "") is None


def test_settings_are_declared_and_agreed():
    from linerate import settings
    from linerate.transport.options import TransportOptions
    o = TransportOptions.from_env({"LINERATE_TLS": "1", "LINERATE_TLS_CERT": "/c",
                                   "LINERATE_TLS_KEY": "/k", "LINERATE_TLS_CA": "/a"})
    assert (o.tls, o.tls_cert, o.tls_key, o.tls_ca) == (True, "/c", "/k", "/a")
    with pytest.raises(ValueError, match="LINERATE_TLS='maybe'"):
        TransportOptions.from_env({"LINERATE_TLS": "maybe"})
    assert settings.read("LINERATE_TLS", {}) is False


# ----------------------------------------------------------------------------- on the wire
_PROBE_SCRIPT = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist
import linerate
RANK = int(os.environ["RANK"])
if os.environ.get("CERT_DIR"):
    d = os.environ["CERT_DIR"]
    os.environ["LINERATE_TLS_CERT"] = os.path.join(d, "rank%d.pem" % RANK)
    os.environ["LINERATE_TLS_KEY"] = os.path.join(d, "rank%d.key" % RANK)
dist.init_process_group("linerate", timeout=datetime.timedelta(seconds=60))
pattern = b"LINERATE-TLS-PROBE"
raw = (pattern * ((4 << 20) // len(pattern) + 1))[: 4 << 20]
t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
b = t.clone() if RANK == 0 else torch.zeros_like(t)
dist.broadcast(b, 0)
a = t.clone()
dist.all_reduce(a, op=dist.ReduceOp.MAX)
ctx = dist.group.WORLD._get_backend(torch.device("cpu"))._ctx
kinds = sorted({"TlsStream" if c["tls"] else "socket" for p in ctx.stats()["peers"]
                for link in p["links"] for c in link["connections"]})
with open(os.environ["OUT"] + ".rank%d" % RANK, "w") as f:
    json.dump({"ok": bool(torch.equal(b, t) and torch.equal(a, t)), "kinds": kinds}, f)
dist.destroy_process_group()
"""


def _capture(lab, host, pcap: Path, body) -> bytes:
    """Run ``body()`` while tcpdump records every packet of ``host``'s first interface."""
    from linerate.tools import netlab
    # -B: a 64 MiB capture buffer, so that a loaded machine's tcpdump keeps up
    cmd = netlab.netns_argv(host, ["tcpdump", "-i", host.ifnames[0], "-s", "0", "-U", "-n",
                                   "-B", "65536", "-w", str(pcap)])
    td = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)  # tcpdump opens the interface
        body()
        time.sleep(0.5)
    finally:
        td.terminate()
        _, err = td.communicate(timeout=10)
    data = pcap.read_bytes() if pcap.exists() else b""
    assert len(data) > 24, f"tcpdump captured nothing: {err.decode(errors='replace')}"
    return data


@pytest.mark.netlab
@pytest.mark.timeout(240)
def test_pattern_on_the_wire_without_tls_never_with_it(tmp_path, pki, lab_name):
    """2 netlab hosts at 1 Gbit/s: a 4 MiB tensor of b"LINERATE-TLS-PROBE" repeated is
    broadcast and all_reduced (MAX, same tensor everywhere: the pattern is what travels)."""
    if shutil.which("tcpdump") is None:
        pytest.skip("tcpdump is not installed (apt-get install tcpdump)")
    from linerate.tools import netlab
    lab = netlab.up(lab_name, hosts=2, rate="1gbit")
    script = tmp_path / "probe.py"
    script.write_text(_PROBE_SCRIPT)
    found = {}
    for mode in ("plain", "tls"):
        env = {"OUT": str(tmp_path / mode), "LINERATE_CONNECT_TIMEOUT": "60"}
        if mode == "tls":
            env.update(LINERATE_TLS="1", LINERATE_TLS_CA=str(pki["ca"]), CERT_DIR=str(pki["dir"]))

        def run():
            rc = netlab.run_ranks(lab, 2, [str(script)], env=dict(os.environ, **env), timeout=120)
            assert rc == 0, f"{mode}: ranks failed ({rc})"

        data = _capture(lab, lab.hosts[0], tmp_path / f"{mode}.pcap", run)
        for r in range(2):
            res = json.loads((tmp_path / f"{mode}.rank{r}").read_text())
            assert res["ok"], (mode, r, res)
            assert res["kinds"] == (["TlsStream"] if mode == "tls" else ["socket"]), res
        found[mode] = (data.count(PROBE), len(data))
    plain, secret = found["plain"], found["tls"]
    assert plain[0] > 1000, found            # the tensor's bytes cross the wire in the clear
    assert secret[1] > 4 << 20, found         # ... the TLS capture holds most of the 8 MiB moved
    assert secret[0] == 0, found              # ... and not one copy of the pattern
    print(f"\npattern occurrences / captured bytes: without TLS {plain}, with TLS {secret}")
