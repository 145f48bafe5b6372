"""The documentation cannot drift from the code.

- Every ```bash / ```sh / ```python block of README.md and docs/*.md runs and passes, in order,
  one scratch folder per page (see "Runnable examples" in docs/architecture.md). An HTML
  comment on the line above a fence changes that:
  ``<!-- example: skip: REASON -->`` (not run: needs a cluster, RDMA, a GPU ...),
  ``<!-- example: file NAME -->`` (saved as NAME for a later block of the page),
  ``<!-- example: torchrun N -->`` (a Python block run under ``torchrun --standalone``),
  ``<!-- example: root -->`` (needs root and network namespaces: skipped elsewhere). The root
  blocks of a page may share a netlab lab; one they leave behind is taken down after the page.
- The docs site builds with ``mkdocs build --strict`` (a broken link, a page missing from the
  navigation or a bad API reference fails it).
- docs/settings.md is what ``python -m linerate.settings --page`` writes, and the README's
  settings table agrees with the registry.
- The README stays a guide (at most 350 lines) and no file speaks of numbered working periods.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from _harness import TAG_VAR, kill_tagged, netlab_reason

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
RUN_LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
BLOCK_TIMEOUT = 90.0
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*example:\s*(?P<what>.*?)\s*-->\s*$")


@dataclass
class Block:
    page: str
    line: int          # 1-based line of the opening fence
    lang: str          # the fence's first word, lowercased
    text: str
    directive: str = ""  # the text after "example:" on the line above, or ""
    args: list = field(default_factory=list)


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, each with the directive written above it."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        info = m.group("info").strip()
        lang = re.split(r"[\s{]", info, 1)[0].lower().lstrip(".") if info else ""
        directive = ""
        if i > 0:
            d = _DIRECTIVE.match(lines[i - 1])
            if d:
                directive = d.group("what")
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        out.append(Block(path.name, i + 1, lang, "\n".join(body) + "\n", directive))
        i = j + 1
    return out


def _kind(block: Block) -> tuple[str, str]:
    """(what to do, argument): run / skip / file / torchrun / root / ignore."""
    d = block.directive
    if d.startswith("skip"):
        reason = d[4:].lstrip(" :—-").strip()
        assert reason, f"{block.page}:{block.line}: 'example: skip' needs a reason"
        return "skip", reason
    if d.startswith("file"):
        name = d[4:].strip()
        assert re.fullmatch(r"[\w.\-/]+", name), f"{block.page}:{block.line}: bad file name {name!r}"
        return "file", name
    if block.lang not in RUN_LANGS:
        assert not d, f"{block.page}:{block.line}: directive {d!r} on a ```{block.lang} block"
        return "ignore", ""
    if d.startswith("torchrun"):
        n = d[len("torchrun"):].strip()
        assert n.isdigit() and block.lang in ("python", "py"), \
            f"{block.page}:{block.line}: 'example: torchrun N' goes on a python block"
        return "torchrun", n
    if d == "root":
        return "root", ""
    assert not d, f"{block.page}:{block.line}: unknown directive {d!r}"
    return "run", ""


def _env(scratch: Path) -> dict:
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    # A block's ranks must not inherit the test run's own settings.
    for k in list(env):
        if k.startswith("LINERATE_") or k in ("MASTER_ADDR", "MASTER_PORT", "RANK",
                                              "WORLD_SIZE", "LOCAL_RANK"):
            del env[k]
    env["TMPDIR"] = str(scratch)
    return env


def _run(cmd: list, cwd: Path, env: dict, where: str) -> None:
    token = uuid.uuid4().hex  # tags every process the block starts (torchrun's ranks too)
    proc = subprocess.Popen(cmd, cwd=cwd, env={**env, TAG_VAR: token}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_tagged(token)
        out, _ = proc.communicate()
        pytest.fail(f"{where}: still running after {BLOCK_TIMEOUT:.0f} s\n"
                    f"{out.decode(errors='replace')[-4000:]}")
    finally:  # nothing a block started may outlive it
        kill_tagged(token)
    if proc.returncode != 0:
        pytest.fail(f"{where}: exit status {proc.returncode}\n{out.decode(errors='replace')[-6000:]}")


def _page_id(p: Path) -> str:
    return p.stem if p.parent.name == "docs" else p.name


def _labs() -> set:
    """The netlab labs that have namespaces now, by name."""
    from linerate.tools import netlab
    found = (re.fullmatch(rf"{re.escape(netlab.PREFIX)}(.+)-(?:h[0-9]+|sw)", ns)
             for ns in netlab.list_netns())
    return {m.group(1) for m in found if m}


def _page_param(page: Path):
    """A page whose root examples build netlab labs (and that takes down, after it, the labs
    that came up meanwhile) runs in the netlab tests' xdist group, one at a time with them
    (tests/conftest.py); the other pages run beside anything."""
    root = any(b.directive == "root" for b in blocks_of(page))
    return pytest.param(page, id=_page_id(page),
                        marks=[pytest.mark.xdist_group("netlab")] if root else [])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES])
def test_examples_run(page: Path, tmp_path):
    # A page's root examples may share a lab (one builds it, a later one takes it down): if
    # one fails in between, the lab is taken down here.
    labs = _labs() if any(_kind(b)[0] == "root" for b in blocks_of(page)) \
        and netlab_reason() is None else None
    try:
        _run_examples(page, tmp_path)
    finally:
        if labs is not None:
            from linerate.tools import netlab
            for name in _labs() - labs:
                netlab.down(name)


def _run_examples(page: Path, tmp_path) -> None:
    """Run the page's blocks in order. Blocks marked ``skip`` are the page's own choice (a
    cluster, a GPU, another test runs them): listed, not a skip of this test. Root blocks
    where netlab cannot work are: the test is skipped with that reason if nothing ran."""
    ran, skipped, no_root = 0, [], []
    for block in blocks_of(page):
        kind, arg = _kind(block)
        where = f"{page.relative_to(ROOT)}:{block.line}"
        if kind == "file":
            target = tmp_path / arg
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text)
            continue
        if kind in ("ignore",):
            continue
        if kind == "skip":
            skipped.append(f"{where}: {arg}")
            continue
        if kind == "root":
            reason = netlab_reason()
            if reason is not None:
                no_root.append(f"{where}")
                continue
        script = tmp_path / f"_block_{block.line}.{'py' if RUN_LANGS[block.lang] == 'python' else 'sh'}"
        script.write_text(block.text)
        if kind == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", arg, str(script)]
        elif RUN_LANGS[block.lang] == "python":
            cmd = [sys.executable, str(script)]
        else:
            cmd = ["bash", "-euo", "pipefail", str(script)]
        _run(cmd, tmp_path, _env(tmp_path), where)
        ran += 1
    if skipped:
        print(f"not run, as the page says: {'; '.join(skipped)}")
    if no_root:
        msg = f"netlab unavailable: {netlab_reason()} ({', '.join(no_root)} not run)"
        if ran == 0:
            pytest.skip(msg)
        print(msg)


def test_every_directive_is_understood():
    for page in PAGES:
        for block in blocks_of(page):
            _kind(block)  # asserts on a malformed directive


def test_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean",
                          "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-6000:]
    assert (tmp_path / "site" / "index.html").exists()


def test_settings_page_is_generated_from_the_registry():
    from linerate import settings
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == settings.markdown_page(), \
        "docs/settings.md differs from the registry: python -m linerate.settings --page > docs/settings.md"


def test_readme_settings_rows_agree_with_the_registry():
    from linerate import settings
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"\|\s*`(LINERATE_[A-Z0-9_]+)`\s*\|([^|]*)\|", line)
        if m:
            assert m.group(1) not in rows, f"README's table lists {m.group(1)} twice"
            rows[m.group(1)] = m.group(2).strip()
    assert rows, "the README lists the settings most users touch"
    assert set(rows) <= set(settings.SETTINGS), set(rows) - set(settings.SETTINGS)
    for name, default in rows.items():
        assert default == settings.SETTINGS[name].default_text, (name, default)


def test_readme_is_a_guide():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 350, f"README.md has {n} lines: reference belongs in docs/"


def _project_files() -> list[Path]:
    if shutil.which("git") and (ROOT / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split("\n")
        return [ROOT / p for p in out if p and (ROOT / p).is_file()]
    skip = {".git", ".venv", "site", "__pycache__"}
    return [p for p in ROOT.rglob("*") if p.is_file() and not (skip & set(p.parts))]


def test_no_file_speaks_of_numbered_working_periods():
    pattern = re.compile(r"[Ss]ession [0-9]")
    hits = []
    for p in _project_files():
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "history belongs in git and CHANGELOG.md:\n" + "\n".join(hits[:40])


def test_api_reference_names_every_public_name():
    import linerate
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in linerate.__all__ if f"`linerate.{n}`" not in text]
    assert not missing, f"docs/api.md does not name {missing}"


def test_settings_page_capitalises_no_name():
    """A setting's sentence that starts with a name (tcp, docker/compose.yaml, all_reduce)
    keeps the name as it is spelt."""
    from linerate import settings
    lines = settings.markdown_page().splitlines()
    firsts = [lines[i + 2] for i, line in enumerate(lines) if line.startswith("### LINERATE_")]
    bad = [f for f in firsts if re.match(r"(Tcp|Rdma|Auto|Shm|Torchrun|Pyverbs)\b|[A-Z][a-z]+[_/.]", f)]
    assert not bad, bad


def test_faults_page_lists_every_setting_ranks_must_share():
    """docs/faults.md's list is the code's: Options.agreed() and the transport's
    rendezvous.agreed_settings()."""
    from linerate.collectives.options import Options
    from linerate.transport import rendezvous
    from linerate.transport.options import TransportOptions
    names = {n.split(" ")[0] for n in [*Options().agreed(),
                                       *rendezvous.agreed_settings(TransportOptions(), 1)]
             if n.startswith("LINERATE_")}  # beside the versions every rank must share too
    text = (ROOT / "docs" / "faults.md").read_text()
    section = text.split("## Failures while a group is set up", 1)[1].split("\n## ", 1)[0]
    missing = sorted(n for n in names | {"LINERATE_SHM"} if f"`{n}`" not in section)
    assert not missing, f"docs/faults.md does not list {missing} among the settings ranks share"
