"""The LINERATE_* registry (linerate/settings.py): one declaration per variable, parsed once at
group creation, bad values named; every setting's default reads back to itself; nothing else
reads the environment for a LINERATE_* name."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from linerate import settings
from linerate.collectives.options import Options
from linerate.transport.options import MetricsOptions, TransportOptions

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("linerate", "transport", "collectives", "tools")

#: Every duration setting, and whether 0 is a documented value (LINK_TIMEOUT: the kernel's
#: defaults; CYCLE_MS: no wait for more calls to fuse with).
DURATIONS = {"LINERATE_CONNECT_TIMEOUT": False, "LINERATE_LINK_TIMEOUT": True,
             "LINERATE_CYCLE_MS": True, "LINERATE_METRICS_WINDOW": False}

#: A value each typed setting must refuse.
BAD = {"LINERATE_NSOCKS": "three", "LINERATE_CHUNK_BYTES": "12Q",
       "LINERATE_CONNECT_TIMEOUT": "soon", "LINERATE_LINK_TIMEOUT": "-1",
       "LINERATE_MAX_UNEXPECTED_BYTES": "x", "LINERATE_PREFER_IPV6": "maybe",
       "LINERATE_CHECKSUM": "perhaps", "LINERATE_CREDIT_BYTES": "lots",
       "LINERATE_TRANSPORT": "udp", "LINERATE_SHM": "yes", "LINERATE_RDMA_GID_INDEX": "-5",
       "LINERATE_PIECE_BYTES": "100", "LINERATE_SMALL_BYTES": "abc",
       "LINERATE_ALLREDUCE_ALGO": "fastest", "LINERATE_ROOTED_ALGO": "star",
       "LINERATE_FUSION_BYTES": "-1", "LINERATE_CYCLE_MS": "20000",
       "LINERATE_PARTITION_BYTES": "1K", "LINERATE_METRICS_PORT": "http",
       "LINERATE_METRICS_WINDOW": "0", "LINERATE_LINK_CAPACITY": "eth0=fast"}


def _tree_files() -> list[Path]:
    """The tree's files: tracked, and untracked ones git does not ignore (else every file
    outside .git and .venv)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
        paths = [ROOT / os.fsdecode(f) for f in out.split(b"\0") if f]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in ROOT.rglob("*") if ".git" not in p.parts and ".venv" not in p.parts]
    return [p for p in paths if p.is_file()]


def _leaf_fields(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaf_fields(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------- the registry
def test_every_setting_is_fully_declared():
    scopes = {"transport", "rdma", "collectives", "metrics", "tools", "docker"}
    for s in settings.SETTINGS.values():
        assert s.name.startswith("LINERATE_") and s.doc and s.accepts, s.name
        assert s.scope in scopes, s
        assert s.ok(s.default), f"{s.name}: its default {s.default!r} is not accepted"
        if not s.default_text.startswith("(") and s.default_text not in ("hostname",):
            assert s.parse(s.default_text) == s.default, s.name


def test_options_fields_and_registry_agree_both_ways():
    declared = {s.field for s in settings.SETTINGS.values() if s.field}
    assert declared == set(_leaf_fields(Options()))
    o = Options()
    for s in settings.SETTINGS.values():
        if s.field:
            assert _get(o, s.field) == s.default, s.name  # one default, not two


def test_every_linerate_name_in_the_tree_is_declared():
    """Every LINERATE_* name that code, scripts, compose files or docs use is declared."""
    used = {}
    for path in _tree_files():
        if path.suffix not in (".py", ".sh", ".md", ".yaml", ".yml", ".toml", ".json", ""):
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for name in re.findall(r"\bLINERATE_[A-Z][A-Z0-9_]*[A-Z0-9]\b", text):
            used.setdefault(name, str(path.relative_to(ROOT)))
    missing = {n: p for n, p in used.items() if n not in settings.SETTINGS}
    assert not missing, f"used but not declared in linerate/settings.py: {missing}"


def test_nothing_outside_the_registry_reads_the_environment_for_a_linerate_name():
    """No os.environ / getenv of a LINERATE_* name, and no env.get("LINERATE_...") or
    env["LINERATE_..."] read of any mapping, outside linerate/settings.py."""
    pattern = re.compile(r"(os\.environ|getenv|environ\.get)[^\n]*[\"']LINERATE_"
                         r"|\.get\(\s*[\"']LINERATE_"
                         r"|\[\s*[\"']LINERATE_[A-Z0-9_]*[\"']\s*\](?!\s*=[^=])")
    offenders = []
    for d in SOURCE_DIRS:
        for path in (ROOT / d).rglob("*.py"):
            if path == ROOT / "linerate" / "settings.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_from_env_fills_every_field():
    env = {"LINERATE_NSOCKS": "3", "LINERATE_SOCKET_IFNAME": " eth0,eth1 ",
           "LINERATE_CHUNK_BYTES": "512K", "LINERATE_CONNECT_TIMEOUT": "12.5",
           "LINERATE_LINK_TIMEOUT": "0", "LINERATE_MAX_UNEXPECTED_BYTES": "1G",
           "LINERATE_PREFER_IPV6": "yes", "LINERATE_CHECKSUM": "1", "LINERATE_CREDIT_BYTES": "256K",
           "LINERATE_TRANSPORT": " Auto ", "LINERATE_SHM": "0", "LINERATE_RDMA_DEVICE": "mlx5_0:1",
           "LINERATE_RDMA_GID_INDEX": "3", "LINERATE_PIECE_BYTES": "8M",
           "LINERATE_SMALL_BYTES": "0", "LINERATE_ALLREDUCE_ALGO": "HD",
           "LINERATE_ROOTED_ALGO": "chain", "LINERATE_FUSION_BYTES": "0",
           "LINERATE_CYCLE_MS": "0", "LINERATE_PARTITION_BYTES": "1M",
           "LINERATE_TIMELINE": "/tmp/t-{rank}.json", "LINERATE_METRICS_PORT": "9400",
           "LINERATE_METRICS_ADDR": "127.0.0.1", "LINERATE_METRICS_HOST": "h0",
           "LINERATE_METRICS_WINDOW": "2.5", "LINERATE_LINK_CAPACITY": "eth0=10gbit"}
    o = Options.from_env(env)
    assert o.transport == TransportOptions(
        nsocks=3, socket_ifname="eth0,eth1", chunk_bytes=512 << 10, connect_timeout=12.5,
        link_timeout=0.0, max_unexpected_bytes=1 << 30, prefer_ipv6=True, checksum=True,
        credit_bytes=256 << 10, transport="auto", shm="0", rdma_device="mlx5_0:1", rdma_gid_index=3)
    assert o.metrics == MetricsOptions(port=9400, addr="127.0.0.1", host="h0", window=2.5,
                                       link_capacity="eth0=10gbit")
    assert o.metrics.capacities == {"eth0": 10e9 / 8}
    assert (o.piece_bytes, o.small_bytes, o.allreduce_algo, o.rooted_algo, o.fusion_bytes,
            o.cycle_ms, o.partition_bytes, o.timeline) == (
        8 << 20, 0, "hd", "chain", 0, 0.0, 1 << 20, "/tmp/t-{rank}.json")
    assert Options.from_env({}) == Options()


def test_from_env_reads_this_process_environment(monkeypatch):
    monkeypatch.setenv("LINERATE_SMALL_BYTES", "1K")
    monkeypatch.setenv("LINERATE_METRICS_WINDOW", "3")
    o = Options.from_env()
    assert (o.small_bytes, o.metrics.window) == (1024, 3.0)


@pytest.mark.parametrize("var", sorted(BAD))
def test_bad_value_names_the_variable_and_what_it_accepts(var):
    with pytest.raises(ValueError) as ei:
        Options.from_env({var: BAD[var]})
    msg = str(ei.value)
    assert msg.startswith(f"{var}={BAD[var]!r}: expected "), msg
    assert settings.SETTINGS[var].accepts in msg


def test_small_bytes_abc_names_the_variable():
    """A bad size names the variable and what it accepts, not only "cannot parse size 'abc'"."""
    with pytest.raises(ValueError, match=r"LINERATE_SMALL_BYTES='abc': expected a byte count"):
        Options.from_env({"LINERATE_SMALL_BYTES": "abc"})


def test_declared_names_only():
    with pytest.raises(KeyError, match="not a declared"):
        settings.read("LINERATE_" + "NO_SUCH_THING")


# ----------------------------------------------------------------------------- durations
def _duration_cases():
    for var, zero_ok in DURATIONS.items():
        for bad in ("nan", "NaN", "inf", "-inf", "Infinity", "-1", "-0.5", "1e400"):
            yield var, bad
        if not zero_ok:
            yield var, "0"


@pytest.mark.parametrize("var,bad", list(_duration_cases()))
def test_duration_refuses_nan_inf_and_non_positive(var, bad):
    with pytest.raises(ValueError, match=rf"^{var}="):
        Options.from_env({var: bad})


@pytest.mark.parametrize("var", sorted(DURATIONS))
def test_duration_zero_only_where_documented(var):
    if DURATIONS[var]:
        assert settings.parse(var, "0") == 0
        assert "0" in settings.SETTINGS[var].accepts
    else:
        with pytest.raises(ValueError, match=var):
            settings.parse(var, "0")


@pytest.mark.parametrize("var", sorted(DURATIONS))
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_duration_refused_on_an_options_object(var, value):
    """pg_options objects are checked too (taken as they are, a NaN connect or link timeout
    would wait for ever)."""
    o = Options()
    field = settings.SETTINGS[var].field
    head, _, attr = field.rpartition(".")
    setattr(_get(o, head) if head else o, attr, value)
    with pytest.raises(ValueError, match=rf"{var} \(Options\.{re.escape(field)}\)"):
        o.validate()


@pytest.mark.parametrize("var", sorted(DURATIONS))
def test_duration_nan_fails_group_creation(var, monkeypatch):
    """The group's creator (what torch calls) fails before any socket, naming the variable:
    from the environment, and from a pg_options object."""
    from linerate.collectives.backend import create_process_group
    dist_opts = SimpleNamespace(store=None, group_rank=0, group_size=1, timeout=None,
                                group_id="", global_ranks_in_group=[0])
    monkeypatch.setenv(var, "nan")
    with pytest.raises(ValueError, match=rf"^{var}='nan'"):
        create_process_group(dist_opts)
    monkeypatch.delenv(var)
    o = Options()
    field = settings.SETTINGS[var].field
    head, _, attr = field.rpartition(".")
    setattr(_get(o, head) if head else o, attr, math.nan)
    with pytest.raises(ValueError, match=rf"^{var} "):
        create_process_group(dist_opts, o)


def test_small_bytes_abc_fails_group_creation(monkeypatch):
    from linerate.collectives.backend import create_process_group
    monkeypatch.setenv("LINERATE_SMALL_BYTES", "abc")
    dist_opts = SimpleNamespace(store=None, group_rank=0, group_size=1, timeout=None,
                                group_id="", global_ranks_in_group=[0])
    with pytest.raises(ValueError, match="LINERATE_SMALL_BYTES='abc'"):
        create_process_group(dist_opts)


# ----------------------------------------------------------------------------- the reference
# docs/settings.md is generated from the registry and the README's short table agrees with
# it: tests/test_docs.py checks both.
def test_markdown_table_lists_every_setting():
    table = settings.markdown_table()
    assert all(f"`{name}`" in table for name in settings.SETTINGS)


# ----------------------------------------------------------------------------- pg_options
@pytest.mark.timeout(90)
def test_pg_options_object_is_used_instead_of_the_environment(tmp_path):
    """init_process_group("linerate", pg_options=linerate.Options(...)): the group takes the
    object as it is; the environment (even a bad value in it) is not read."""
    code = textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist, linerate
        store = dist.FileStore(sys.argv[1], 1)
        o = linerate.Options(allreduce_algo="ring", small_bytes=0)
        dist.init_process_group("linerate", store=store, rank=0, world_size=1, pg_options=o)
        t = torch.arange(4.0)
        dist.all_reduce(t)
        pg = dist.group.WORLD
        print("OK", pg.options is o, pg.options.allreduce_algo, t.tolist())
        dist.destroy_process_group()
    """)
    env = dict(os.environ, LINERATE_ALLREDUCE_ALGO="bogus", LINERATE_SMALL_BYTES="abc")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store")], env=env,
                         capture_output=True, text=True, timeout=80, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK True ring [0.0, 1.0, 2.0, 3.0]" in out.stdout, out.stdout


def test_options_from_the_environment_follow_its_changes(monkeypatch):
    """Options.from_env() reuses its last parse of the environment only while no LINERATE_*
    variable changed, and hands out copies (changing one changes no other)."""
    from linerate import Options
    monkeypatch.delenv("LINERATE_SMALL_BYTES", raising=False)
    monkeypatch.delenv("LINERATE_NSOCKS", raising=False)
    a = Options.from_env()
    b = Options.from_env()
    assert a == b and a is not b and a.transport is not b.transport
    a.small_bytes = 1
    a.transport.nsocks = 7
    assert Options.from_env() == b
    monkeypatch.setenv("LINERATE_SMALL_BYTES", "8K")
    monkeypatch.setenv("LINERATE_NSOCKS", "3")
    c = Options.from_env()
    assert c.small_bytes == 8192 and c.transport.nsocks == 3
    monkeypatch.setenv("LINERATE_NSOCKS", "many")
    with pytest.raises(ValueError, match="LINERATE_NSOCKS"):
        Options.from_env()
    monkeypatch.delenv("LINERATE_NSOCKS")
    monkeypatch.delenv("LINERATE_SMALL_BYTES")
    assert Options.from_env() == b


def test_cma_and_slow_link_ratio_are_group_options():
    o = Options.from_env({"LINERATE_CMA": "0", "LINERATE_SLOW_LINK_RATIO": "0.3"})
    assert (o.transport.cma, o.slow_link_ratio) == ("0", 0.3)
    o = Options()
    o.transport.cma = "sometimes"
    with pytest.raises(ValueError, match=r"LINERATE_CMA \(Options.transport.cma\)"):
        o.validate()
