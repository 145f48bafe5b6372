"""Every rank of a group runs the same linerate: a rank of another version (faked in its
process) makes group creation fail on every rank, each error naming the rank and both
versions; a rank of a linerate too old to compare versions is named by the others from its host
record; a segment of another layout is refused naming both layouts."""
from __future__ import annotations

import pytest

from _harness import run_rank_scripts

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
import linerate
from linerate.transport import rendezvous, shm

fake = os.environ.get("FAKE_LINERATE_VERSION")
if fake:
    linerate.__version__ = fake
if os.environ.get("EMULATE_OLD_LINERATE"):
    # A linerate from before the versions were compared: its agreement record and host record
    # say none, and it checks none (it fails once it learns of the others' failure).
    real = rendezvous.agreed_settings
    rendezvous.agreed_settings = lambda o, n: {k: v for k, v in real(o, n).items()
                                               if k != rendezvous.VERSION_KEY}
    shm.version_text = lambda: None
    shm.LAYOUT_VERSION, shm._MAGIC = 2, b"LRSHM\\x00\\x02\\x00"  # its segment layout
    shm.version_mismatch = lambda *a: (time.sleep(3), RuntimeError("old rank gave up"))[1]
print("VERSION", rendezvous.version_text(), flush=True)
t0 = time.monotonic()
try:
    dist.init_process_group("linerate", timeout=timedelta(seconds=30))
except Exception as e:
    print(f"FAILED after {time.monotonic() - t0:.1f}s:", type(e).__name__, e, flush=True)
    sys.exit(3)
print("CREATED", flush=True)
dist.destroy_process_group()
"""


def _real_version() -> str:
    from linerate.transport.rendezvous import version_text
    return version_text()


@pytest.mark.parametrize("odd", [1, 0], ids=["rank1-differs", "rank0-differs"])
@pytest.mark.parametrize("shm", ["auto", "0"])
def test_a_rank_of_another_version_fails_every_rank_naming_both(tmp_path, odd, shm):
    out = run_rank_scripts(tmp_path, SCRIPT, 3, timeout=60, env={"LINERATE_SHM": shm},
                           per_rank_env={odd: {"FAKE_LINERATE_VERSION": "9.9.9"}})
    real = _real_version()
    fake = real.replace(f"linerate {real.split()[1]} ", "linerate 9.9.9 ")
    for r, (code, text) in enumerate(out):
        assert code == 3 and "FAILED" in text, (r, text)
        line = next(x for x in text.splitlines() if x.startswith("FAILED"))
        # the error names the ranks compared and both versions: rank 0's and the rank's that
        # found the difference (rank 1's when it differs; rank 1's or 2's when rank 0 does)
        assert real in line and fake in line and "rank 0 runs linerate" in line, (r, line)
        assert "rank 1: " in line if odd == 1 else ("rank 1: " in line or "rank 2: " in line), \
            (r, line)
        assert float(line.split()[2].rstrip("s:")) < 20, line  # not the connect timeout


def test_a_rank_too_old_to_compare_versions_is_named_by_the_others(tmp_path):
    out = run_rank_scripts(tmp_path, SCRIPT, 3, timeout=60,
                           per_rank_env={2: {"EMULATE_OLD_LINERATE": "1"}})
    real = _real_version()
    for r, (code, text) in enumerate(out):
        assert code == 3 and "FAILED" in text, (r, text)
    for r in (0, 1):
        line = next(x for x in out[r][1].splitlines() if x.startswith("FAILED"))
        assert "rank 2 runs an older linerate" in line and real in line, (r, line)


def test_a_segment_of_another_layout_is_refused_naming_both():
    import mmap
    import os
    import struct

    from linerate.transport import shm
    secret = os.urandom(32)
    name, path, token, buf = shm._create(2)
    try:
        mac = shm._mac(secret, name, token)
        shm._attach(name, 2, secret, mac)  # this layout: accepted
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 8)
            mm[6:8] = struct.pack("<H", shm.LAYOUT_VERSION - 1)
            mm.close()
        with pytest.raises(shm.ShmRefused) as e:
            shm._attach(name, 2, secret, mac)
        assert (f"layout {shm.LAYOUT_VERSION - 1}, this rank's linerate {shm.LAYOUT_VERSION}"
                in str(e.value)), e.value
    finally:
        shm._unlink(path)
    assert shm._MAGIC == b"LRSHM\x00" + struct.pack("<H", shm.LAYOUT_VERSION)
