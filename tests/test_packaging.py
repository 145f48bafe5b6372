"""Packaging: one import name (``linerate``), a wheel that works with no source tree around it,
torch's entry point that survives a user's own ``tools``/``transport``/``collectives`` packages,
and one version.

The wheel test builds with ``pip wheel --no-deps --no-build-isolation`` (no download) from a copy
of the tree, installs it with ``pip install --no-deps --no-index`` into a fresh virtual
environment that sees this interpreter's torch (and nothing of linerate: its editable install is
left out) and runs, from a folder outside the tree, ``linerate --version`` and a 2-rank
all_reduce in two processes that never import linerate themselves. It is marked ``slow``
(about 30-60 s; ``-m "not slow"`` leaves it out).
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

import linerate

ROOT = Path(__file__).resolve().parent.parent
DECOYS = ("tools", "transport", "collectives")

# Two ranks over a FileStore, in two processes; neither imports linerate (torch's entry point
# registers the backend at `import torch`). Prints one line per rank.
RANKS = textwrap.dedent("""
    import os, subprocess, sys
    if len(sys.argv) == 2:  # the launcher: start the two ranks, wait for both
        procs = [subprocess.Popen([sys.executable, __file__, sys.argv[1], str(r)]) for r in range(2)]
        try:
            codes = [p.wait(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        sys.exit(max(codes))
    import torch, torch.distributed as dist
    path, rank = sys.argv[1], int(sys.argv[2])
    assert "linerate" in dist.Backend.backend_list, dist.Backend.backend_list
    dist.init_process_group("linerate", init_method="file://" + path, rank=rank, world_size=2)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1000,), 3.0)), t[:4]
    import linerate
    # One write per line (print writes the text and the newline apart when unbuffered, and
    # the two ranks share the pipe: their lines once interleaved).
    os.write(1, (f"rank {rank}: all_reduce ok, backend {dist.get_backend()}, linerate "
                 f"{linerate.__version__} from {os.path.dirname(linerate.__file__)}\\n").encode())
    dist.destroy_process_group()
""")

# One rank: the backend is registered at `import torch`, a group works, `import linerate` works.
ONE_RANK = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    assert "linerate" in dist.Backend.backend_list, dist.Backend.backend_list
    dist.init_process_group("linerate", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    t = torch.arange(4.0)
    dist.all_reduce(t)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    dist.destroy_process_group()
    import linerate, linerate.transport, linerate.collectives, linerate.tools
    for name in ("tools", "transport", "collectives"):
        assert name not in sys.modules, name
    print("ok", linerate.__version__, linerate.__file__, flush=True)
""")


def _decoys(where: Path) -> Path:
    """Packages named like our folders, whose import raises, as a user's project may have."""
    for name in DECOYS:
        (where / name).mkdir(parents=True)
        (where / name / "__init__.py").write_text(
            f"raise ImportError('decoy {name}: a user package that must never be imported')\n")
    return where


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LINERATE_", "PYTHONPATH", "TORCH_DEVICE_BACKEND_AUTOLOAD"))}
    env.update(extra)
    return env


# ----------------------------------------------------------------------------- this interpreter
def test_version_is_the_installed_metadata_version():
    try:
        installed = importlib.metadata.version(linerate.DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        # a checkout on the path, not installed (the GPU host check): the version says so
        assert linerate.__version__ == "0+unknown"
        pytest.skip(f"{linerate.DISTRIBUTION} is not installed: the package runs from a checkout")
    assert linerate.__version__ == installed
    from linerate.tools import __version__ as tools_version
    assert tools_version == linerate.__version__


@pytest.mark.timeout(120)
def test_decoy_packages_first_on_the_path_change_nothing(tmp_path):
    """A user's `tools`, `transport` and `collectives` packages (raising on import) first on
    sys.path: `import torch` still works, the backend is registered, a group runs, and
    `import linerate` works."""
    decoys = _decoys(tmp_path / "decoys")
    out = subprocess.run([sys.executable, "-c", ONE_RANK, str(tmp_path / "store")],
                         cwd=decoys, env=_env(PYTHONPATH=str(decoys)), capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.startswith("ok "), out.stdout
    assert "decoy" not in out.stderr, out.stderr[-4000:]


# ----------------------------------------------------------------------------- the wheel
def _copy_tree(dest: Path) -> Path:
    """The working tree's files (tracked, and untracked ones git does not ignore)."""
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = ROOT / os.fsdecode(f)
        if src.is_file():
            (dest / os.fsdecode(f)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(f))
    return dest


def _torch_only_site(dest: Path) -> Path:
    """A folder of links to this interpreter's site-packages entries, without linerate (its
    editable install, metadata and finder) nor pip/setuptools: what the fresh environment may
    see of ours is torch and the other dependencies."""
    dest.mkdir()
    skip = ("linerate", "torch_linerate", "__editable__", "_distutils_hack", "distutils-precedence",
            "pip", "setuptools", "__pycache__")
    for folder in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(folder).iterdir():
            if entry.name.startswith(skip) or entry.suffix == ".pth" or (dest / entry.name).exists():
                continue
            (dest / entry.name).symlink_to(entry)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src = _copy_tree(work / "src")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps",
                          "--no-build-isolation", "--no-index", "-q", "-w", str(work / "dist")],
                         cwd=src, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    wheels = list((work / "dist").glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_holds_only_linerate(wheel):
    assert wheel.name.startswith("torch_linerate-"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = {n.split("/", 1)[0] for n in names}
        dist_info = [t for t in top if t.endswith(".dist-info")]
        assert top == {"linerate", *dist_info} and len(dist_info) == 1, sorted(top)
        for sub in ("transport", "transport/shm", "collectives", "tools", "tools/dev"):
            assert f"linerate/{sub}/__init__.py" in names, sub
        assert "linerate/settings.py" in names and "linerate/tools/quickstart.sh" in names
        assert not any(n.startswith("linerate/tests/") for n in names)
        entry_points = z.read(f"{dist_info[0]}/entry_points.txt").decode()
    assert "linerate = linerate._torch_hook:autoload" in entry_points, entry_points
    assert "linerate = linerate.tools.cli:main" in entry_points, entry_points


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_installs_and_runs_in_a_clean_venv(wheel, tmp_path):
    """Install the wheel into a fresh venv that sees this interpreter's torch but no linerate,
    then, from a folder outside the tree (with decoy packages first on the path): `linerate
    --version` and a 2-rank all_reduce over the backend that torch's entry point registered."""
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(str(_torch_only_site(tmp_path / "deps")) + "\n")
    outside = _decoys(tmp_path / "elsewhere")
    env = _env(PYTHONPATH=str(outside))
    before = subprocess.run([str(py), "-c", "import linerate"], cwd=outside, env=env,
                            capture_output=True, text=True, timeout=60)
    assert before.returncode != 0 and "No module named 'linerate'" in before.stderr, before.stderr
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                          "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    version = subprocess.run([str(venv / "bin" / "linerate"), "--version"], cwd=outside, env=env,
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stderr[-3000:]
    want = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('torch-linerate'))"],
                          cwd=outside, env=env, capture_output=True, text=True, timeout=60).stdout.strip()
    assert version.stdout.strip() == f"linerate {want}", version.stdout

    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    ranks = subprocess.run([str(py), str(script), str(tmp_path / "store")], cwd=outside, env=env,
                           capture_output=True, text=True, timeout=150)
    assert ranks.returncode == 0, ranks.stdout[-2000:] + ranks.stderr[-4000:]
    lines = sorted(line for line in ranks.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], ranks.stdout
    for line in lines:
        assert f"backend linerate, linerate {want} from {site}" in line, (line, site)
