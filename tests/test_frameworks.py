"""The recipes of docs/frameworks.md, run as users run them: each script and its launch command
are taken from the page itself (the ```python block under ``<!-- example: file NAME -->`` and
the ```bash block under ``<!-- example: skip: run by tests/test_frameworks.py -->`` that names
NAME), so the page and this test cannot drift apart. Each run is 2 ranks; every script checks
on each rank that it trained and which backend its process group has, and prints a marker line
that the test looks for. A recipe whose framework is not installed here is skipped with the
reason (the frameworks are the optional extra ``frameworks``); one that is installed but does
not import fails."""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from _harness import REPO, TAG_VAR, free_port, kill_tagged

PAGE = Path(REPO) / "docs" / "frameworks.md"
RUN_MARK = "<!-- example: skip: run by tests/test_frameworks.py -->"
FILE_MARK = re.compile(r"<!-- example: file (\S+) -->")
RUN_TIMEOUT = 150  # seconds for one launch (2 ranks); the pytest timeouts leave room above it


def _blocks() -> list[tuple[str, str, str]]:
    """(marker comment above the fence or "", language, text) for every fenced block of the page."""
    lines = PAGE.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        above = lines[i - 1].strip() if i > 0 else ""
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        out.append((above if above.startswith("<!--") else "", m.group(1),
                    "\n".join(lines[i + 1:j]) + "\n"))
        i = j + 1
    return out


def scripts() -> dict[str, str]:
    """NAME -> the text of the page's block marked ``<!-- example: file NAME -->``."""
    found = {}
    for mark, _, text in _blocks():
        m = FILE_MARK.fullmatch(mark)
        if m:
            assert m.group(1) not in found, f"{PAGE}: two blocks named {m.group(1)}"
            found[m.group(1)] = text
    return found


def launch_command(name: str) -> str:
    """The page's one launch command (a block marked as run here) that names ``name``."""
    cmds = [text.strip() for mark, _, text in _blocks()
            if mark == RUN_MARK and re.search(rf"(^|\s){re.escape(name)}(\s|$)", text)]
    assert len(cmds) == 1, f"{PAGE}: expected one launch command for {name}, found {cmds}"
    return cmds[0]


#: The start of the skip reason where a framework is not installed (tests/conftest.py accepts it).
NOT_INSTALLED = "optional extra 'frameworks' not installed"


def need(module: str) -> None:
    """Skip where ``module`` is not installed (the optional extra). Installed, it must import:
    a failure is this test's failure, not a skip (torchvision built for CUDA beside a CPU
    torch, for one, makes Lightning's import fail with a RuntimeError)."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{NOT_INSTALLED}: no {module} (pip install '.[frameworks]' torch==2.13.0)")
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - reported as the failure it is
        pytest.fail(f"{module} is installed but does not import: {type(e).__name__}: {e}")


def _env(extra: dict | None = None) -> dict:
    venv_bin = os.path.dirname(sys.executable)
    env = dict(os.environ)
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)  # the scripts rely on the entry point
    env.update(PATH=venv_bin + os.pathsep + env.get("PATH", ""), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra or {})
    return env


def _run(cmds: list[list[str]], cwd: Path, envs: list[dict]) -> str:
    """Start every command, wait for all; at RUN_TIMEOUT kill every process they started.
    Returns their output, the commands' in order; fails on a nonzero exit."""
    token = uuid.uuid4().hex
    procs = [subprocess.Popen(c, cwd=cwd, env={**e, TAG_VAR: token}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for c, e in zip(cmds, envs)]
    outs = []
    try:
        for p in procs:
            try:
                text, _ = p.communicate(timeout=RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                kill_tagged(token)
                text, _ = p.communicate()
                pytest.fail(f"{p.args} still running after {RUN_TIMEOUT}s:\n{text[-4000:]}")
            outs.append(text)
    finally:  # whatever happened, nothing of this launch stays behind
        for q in procs:
            if q.poll() is None:
                q.kill()
            q.wait()
        kill_tagged(token)
    out = "\n".join(outs)
    for p in procs:
        assert p.returncode == 0, f"{p.args} exited with {p.returncode}:\n{out[-6000:]}"
    return out


def run_recipe(name: str, tmp_path: Path) -> str:
    """Write the page's script ``name`` into tmp_path and run its launch command there (bash,
    the venv's bin first on PATH, as a user's shell would)."""
    (tmp_path / name).write_text(scripts()[name])
    return _run([["bash", "-euo", "pipefail", "-c", launch_command(name)]], tmp_path, [_env()])


def assert_markers(out: str, marker: str, world: int = 2) -> None:
    for r in range(world):
        assert f"rank {r}: {marker}" in out, f"rank {r} did not print {marker!r}:\n{out[-6000:]}"


# ----------------------------------------------------------------------------- the page itself
TESTED = {"train_ddp.py", "train_slurm.py", "train_lightning.py", "train_lightning_fsdp.py",
          "train_accelerate.py", "train_trainer.py", "device_map.py", "train_mixed.py"}


def test_every_recipe_on_the_page_is_run_here():
    assert set(scripts()) == TESTED, "a recipe was added to or removed from docs/frameworks.md: " \
                                     "add or remove its test here"
    for mark, lang, _ in _blocks():
        if lang in ("bash", "sh", "python"):
            assert mark.startswith("<!-- example: skip:") or FILE_MARK.fullmatch(mark), \
                f"{PAGE}: a runnable block without a marker would also run in tests/test_docs.py"


# ----------------------------------------------------------------------------- torch alone
@pytest.mark.timeout(180)
def test_torchrun_ddp(tmp_path):
    assert_markers(run_recipe("train_ddp.py", tmp_path), "trained, backend linerate")


@pytest.mark.timeout(180)
def test_slurm_env_from_srun_variables(tmp_path):
    """What srun does: one process per rank, SLURM_* set, MASTER_ADDR/PORT exported."""
    (tmp_path / "train_slurm.py").write_text(scripts()["train_slurm.py"])
    port = str(free_port())
    envs = [_env({"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
                  "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
            for r in range(2)]
    out = _run([[sys.executable, "train_slurm.py"]] * 2, tmp_path, envs)
    assert_markers(out, "trained, backend linerate")


@pytest.mark.timeout(180)
def test_device_map_string_is_linerate_for_every_device(tmp_path):
    out = run_recipe("device_map.py", tmp_path)
    assert_markers(out, "all_reduce ok, backend cpu:linerate,cuda:nccl, "
                        "CUDA tensors go to ProcessGroupLinerate")


@pytest.mark.timeout(180)
def test_mixed_default_group_plus_linerate_group(tmp_path):
    out = run_recipe("train_mixed.py", tmp_path)
    assert_markers(out, "trained, backend linerate for CPU tensors")


# ----------------------------------------------------------------------------- Lightning
@pytest.mark.timeout(180)
def test_lightning_ddp_strategy(tmp_path):
    need("lightning")
    out = run_recipe("train_lightning.py", tmp_path)
    assert "distributed_backend=linerate" in out, out[-6000:]
    assert_markers(out, "trained, backend linerate")


@pytest.mark.timeout(180)
def test_lightning_model_parallel_fully_shard(tmp_path):
    need("lightning")
    out = run_recipe("train_lightning_fsdp.py", tmp_path)
    assert_markers(out, "trained, backend linerate")


@pytest.mark.processes  # on a GPU host Lightning's Trainer starts a process of its own
@pytest.mark.timeout(60)
def test_lightning_fsdp_strategy_refuses_cpu():
    """The page says strategy="fsdp" needs a GPU whatever the backend: still so?"""
    need("lightning")
    import lightning as L
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(accelerator="cpu", devices=2, strategy="fsdp", logger=False)


# ----------------------------------------------------------------------------- Hugging Face
@pytest.mark.timeout(180)
def test_accelerate_keeps_an_existing_linerate_group(tmp_path):
    need("accelerate")
    out = run_recipe("train_accelerate.py", tmp_path)
    # The page says accelerate's own field still reads gloo: if this changes, update the page.
    assert_markers(out, "trained, backend linerate (accelerate's field says gloo)")


@pytest.mark.timeout(180)
def test_transformers_trainer_keeps_an_existing_linerate_group(tmp_path):
    need("accelerate")
    need("transformers")
    out = run_recipe("train_trainer.py", tmp_path)
    assert_markers(out, "trained, backend linerate (accelerate's field says gloo)")
