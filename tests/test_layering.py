"""The layers as docs/architecture.md draws them, read from the source (an AST walk, no import):
transport/ never imports collectives/, and no module of either reads another module's private
names (``obj._x`` where ``_x`` is not defined in the reading module, or ``from m import _x``).
A private name is a module's own business: what another module needs is public, named and
documented where it is defined."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = ("transport", "collectives")

#: Private names of other projects that these modules use on purpose, each with why.
FOREIGN = {
    # torch's multi-tensor kernels: the public optimizers use them too (no public spelling)
    **{f"_foreach_{op}": "torch's multi-tensor kernels" for op in (
        "add", "add_", "addcdiv_", "addcmul_", "copy_", "div_", "mul_", "sqrt_", "zero_")},
    "_debug_has_internal_overlap": "torch: whether a tensor's elements overlap (stage.py)",
    "_get_backend": "torch's ProcessGroup: the backend object of a device",
    "_Work": "torch: the C++ Work that a Python Work must derive from",
    "_get_handler_names": "logging: the registered handler names (flight.py's exit hook)",
    "_register_handler": "torch.distributed.elastic: the error handler (flight.py)",
}


def _modules(layer: str):
    return sorted((ROOT / layer).rglob("*.py"))


def _defined(tree: ast.AST) -> set[str]:
    """Every name a module defines or binds: functions, classes, attributes it assigns,
    variables, parameters, imports, __slots__ entries."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            names.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.alias):
            names.add(n.asname or n.name.split(".")[-1])
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                               for t in n.targets):
            names.update(c.value for c in ast.walk(n.value)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return names


def _private_module(package: str | None, name: str) -> bool:
    """Whether ``from package import name`` imports a private module of the project (such as
    linerate/_log.py): a package's own modules, made private to keep them out of its API."""
    if not package or not package.startswith("linerate"):
        return False
    return (ROOT / package.split(".", 1)[0] / f"{name}.py").exists()


def _private_reads(path: pathlib.Path) -> list[str]:
    return _private_reads_in(path.read_text(), str(path.relative_to(ROOT)))


def _private_reads_in(src: str, where: str) -> list[str]:
    tree = ast.parse(src, where)
    own = _defined(tree)
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                continue
            if n.attr in own or n.attr in FOREIGN:
                continue
            bad.append(f"{where}:{n.lineno}: reads .{n.attr} of another module's object")
        elif isinstance(n, ast.ImportFrom):
            for a in n.names:
                if (a.name.startswith("_") and not a.name.startswith("__")
                        and not _private_module(n.module, a.name)):
                    bad.append(f"{where}:{n.lineno}: imports {a.name} from {n.module}")
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_no_private_name_is_read_across_modules(layer):
    bad = [b for p in _modules(layer) for b in _private_reads(p)]
    assert not bad, "\n".join(bad)


def test_transport_never_imports_collectives():
    bad = []
    for p in _modules("transport"):
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            mods = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                    [n.module or ""] if isinstance(n, ast.ImportFrom) else [])
            bad += [f"{p.relative_to(ROOT)}:{n.lineno}: imports {m}" for m in mods
                    if m.startswith(("linerate.collectives", "collectives"))]
    assert not bad, "\n".join(bad)


def test_the_rule_sees_a_private_read():
    """The walk itself: a read of another module's private attribute is found, the module's
    own names and self's are not."""
    src = ("import other\nfrom other import _hidden\nclass A:\n    def __init__(self):\n"
           "        self._mine = 1\n    def f(self, o):\n"
           "        return self._mine, o._mine, other._theirs, other.__doc__\n")
    assert _private_reads_in(src, "m.py") == ["m.py:2: imports _hidden from other",
                                              "m.py:7: reads ._theirs of another module's object"]
