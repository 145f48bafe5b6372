"""The ``unit`` tier, read from how a test is built, and checked while it runs (tests/conftest.py).

A test is ``unit`` exactly when it starts no process. Whether it may start one is read from its
code at collection: the test function, the fixtures it uses and every function, class and
module of tests/ that they refer to (the helpers of tests/_harness.py among them), followed
through names, attributes and nested functions. A test starts processes when that code reaches
one of PROCESS_MODULES (subprocess, multiprocessing, ...) or PROCESS_FUNCTIONS (os.fork,
os.system, ...): run_ranks, run_rank_scripts and run_netlab_script reach them, so every test
that uses one of them is not unit. Ranks as threads (tests/_threads.py) start no process: unit.

What the reading cannot see (product code that starts processes, such as a command that
launches ranks) is caught while the test runs: during a ``unit`` test, starting a process
(subprocess.Popen, a multiprocessing Process, os.fork, os.posix_spawn, os.system ...) fails the
test, naming it. Such a test says so with ``@pytest.mark.processes``, which takes it out of
the unit tier.
"""
from __future__ import annotations

import dis
import functools
import inspect
import os
import sys
import threading
import types
import warnings

TESTS = os.path.dirname(os.path.abspath(__file__))

#: Modules whose use starts processes (by name, also where imported inside a function).
PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "pty",
                   "concurrent.futures.process", "asyncio.subprocess")
#: Functions of ``os`` that start processes.
PROCESS_FUNCTIONS = ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp",
                     "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve",
                     "spawnvp", "spawnvpe")
_OS_STARTERS = {id(getattr(os, n)) for n in PROCESS_FUNCTIONS if hasattr(os, n)}


def _process_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in PROCESS_MODULES)


def _ours(obj) -> bool:
    """Defined in tests/ (a test module, conftest, a helper module)."""
    path = None
    if isinstance(obj, types.ModuleType):
        path = getattr(obj, "__file__", None)
    elif isinstance(obj, (types.FunctionType, type)):
        mod = sys.modules.get(getattr(obj, "__module__", None) or "")
        path = getattr(mod, "__file__", None)
        if isinstance(obj, types.FunctionType):
            path = obj.__code__.co_filename
    return bool(path) and os.path.dirname(os.path.abspath(path)) == TESTS


def _starts(obj) -> str | None:
    """What ``obj`` is, if it starts processes by itself."""
    if isinstance(obj, types.ModuleType) and _process_module(obj.__name__):
        return obj.__name__
    if id(obj) in _OS_STARTERS:
        return f"os.{obj.__name__}"
    mod = getattr(obj, "__module__", None)
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)) and mod \
            and _process_module(mod):
        return f"{mod}.{obj.__name__}"
    return None


class Reader:
    """Which process starter a function of tests/ reaches (None: none). What a walk that found
    nothing visited reaches nothing: it is not read again."""

    def __init__(self):
        self._clean: set = set()  # ids of code objects that reach no starter
        self._dirty: dict = {}  # id of a code object -> the calls from it to a starter
        self._partial = False  # a walk met a code object it had not finished
        self._found: dict = {}  # id of an object asked about -> what it reaches
        self._ops: dict = {}  # id of a code object -> its instructions

    def reaches(self, obj) -> str | None:
        if id(obj) in self._found:
            return self._found[id(obj)]
        visited: set = set()
        with warnings.catch_warnings():  # a module's attribute may warn when read
            warnings.simplefilter("ignore")
            found = self._walk(obj, visited, ())
        if found is None:
            self._clean |= visited
        self._found[id(obj)] = found = None if found is None else " -> ".join(found)
        return found

    def _walk(self, obj, visited: set, path: tuple):
        obj = inspect.unwrap(getattr(obj, "__func__", obj))
        inner = getattr(getattr(obj, "hypothesis", None), "inner_test", None)  # @given
        if inner is not None:
            obj = inner
        if isinstance(obj, functools.partial):
            return self._walk(obj.func, visited, path)
        what = _starts(obj)
        if what is not None:
            return path + (what,)
        if not isinstance(obj, (types.FunctionType, type)) or not _ours(obj):
            return None  # a module of tests/ is reached through the names taken from it
        name = getattr(obj, "__qualname__", obj.__name__)
        if isinstance(obj, type):
            if id(obj) in visited:
                return None
            visited.add(id(obj))
            for v in vars(obj).values():
                found = self._walk(v, visited, path + (name,))
                if found:
                    return found
            return None
        return self._code(obj.__code__, obj.__globals__, visited, path + (name,))

    def _code(self, code, glb: dict, visited: set, path: tuple):
        key = id(code)
        if key in self._dirty:
            return path + self._dirty[key]
        if key in self._clean:
            return None
        if key in visited:  # met again in this walk: known only once the walk is over
            self._partial = True
            return None
        visited.add(key)
        partial, self._partial = self._partial, False
        found = self._scan(code, glb, visited, path)
        if found is not None:
            self._dirty[key] = found[len(path):]
        elif not self._partial:
            self._clean.add(key)
        self._partial = self._partial or partial
        return found

    def _scan(self, code, glb: dict, visited: set, path: tuple):
        builtins = glb.get("__builtins__", {})
        builtins = vars(builtins) if isinstance(builtins, types.ModuleType) else builtins
        cur = None  # the object the previous instruction loaded, for an attribute after it
        ops = self._ops.get(id(code))
        if ops is None:
            ops = ([(i.opname, i.argval) for i in dis.get_instructions(code)]
                   if _names_matter(code, glb, builtins) else [])
            self._ops[id(code)] = ops
        for op, arg in ops:
            nxt = None
            if op in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(arg, str):
                nxt = glb.get(arg, builtins.get(arg))
            elif op == "IMPORT_NAME" and isinstance(arg, str):
                if _process_module(arg):
                    return path + (f"import {arg}",)
                nxt = sys.modules.get(arg)
            elif op in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM") and isinstance(arg, str):
                if isinstance(cur, types.ModuleType):
                    sub = f"{cur.__name__}.{arg}"
                    if op == "IMPORT_FROM" and _process_module(sub):
                        return path + (sub,)
                    nxt = getattr(cur, arg, None) or sys.modules.get(sub)
                elif isinstance(cur, type):
                    nxt = getattr(cur, arg, None)
            if nxt is not None:
                found = self._walk(nxt, visited, path)
                if found:
                    return found
                for v in (nxt.values() if isinstance(nxt, dict) else
                          nxt if isinstance(nxt, (list, tuple)) else ()):
                    if isinstance(v, (types.FunctionType, type, functools.partial)):
                        found = self._walk(v, visited, path)
                        if found:
                            return found
            cur = nxt
        for const in code.co_consts:  # nested functions and lambdas
            if isinstance(const, types.CodeType):
                found = self._code(const, glb, visited, path + (const.co_name,))
                if found:
                    return found
        return None


def _matters(obj) -> bool:
    return (_starts(obj) is not None or _ours(obj)
            or isinstance(obj, (dict, list, tuple, functools.partial)))


def _names_matter(code, glb: dict, builtins: dict) -> bool:
    """Whether a name of ``code`` may lead to a starter (else its instructions need no
    reading): a process module, or something of tests/, or a module with such an attribute
    among the names."""
    names = code.co_names
    for name in names:
        if _process_module(name):
            return True
        obj = glb.get(name, builtins.get(name, sys.modules.get(name)))
        if obj is None:
            continue
        if _matters(obj):
            return True
        if isinstance(obj, types.ModuleType):
            for attr in names:
                sub = getattr(obj, attr, None)
                if (sub is not None and _matters(sub)) or \
                        _process_module(f"{obj.__name__}.{attr}"):
                    return True
    return False


def item_starts_processes(reader: Reader, item) -> str | None:
    """Why ``item`` (a pytest test) may start processes; None: it starts none (``unit``)."""
    if item.get_closest_marker("processes") is not None:
        return "marked processes"
    if item.get_closest_marker("netlab") is not None:
        return "marked netlab"
    found = reader.reaches(getattr(item, "obj", None))
    if found:
        return found
    info = getattr(item, "_fixtureinfo", None)
    for name in (info.names_closure if info is not None else ()):
        for fixturedef in info.name2fixturedefs.get(name, ()):
            found = reader.reaches(fixturedef.func)
            if found:
                return f"fixture {name}: {found}"
    return None


# ----------------------------------------------------------------------------- the check
class NotUnitTier(AssertionError):
    pass


class Guard:
    """While a ``unit`` test runs, starting a process fails it (see the module docstring)."""

    def __init__(self):
        self.nodeid: str | None = None
        self.started: list[str] = []
        self._saved: list = []
        #: Threads alive when the test began, but the main thread: a process one of them
        #: starts is an earlier test's leftover (a process-tier test's helper still winding
        #: down), not this test's doing: let through.
        self._before: set = set()

    def _refuse(self, what: str, args: tuple = ()):
        import traceback
        # what was started and from where: the command of a Popen, and the last frame that is
        # not subprocess's, multiprocessing's or this guard's (a library's helper shows here)
        command = ""
        if what == "subprocess.Popen" and len(args) > 1:
            command = f" `{' '.join(map(str, args[1])) if isinstance(args[1], (list, tuple)) else args[1]}`"
        frames = [f for f in traceback.extract_stack()[:-2]
                  if os.path.basename(f.filename) not in ("subprocess.py", "_tiers.py",
                                                          "process.py", "context.py",
                                                          "popen_fork.py")]
        where = f" from {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        msg = (f"{self.nodeid} started a process ({what}{command}{where}, in thread "
               f"{threading.current_thread().name}) but is in the unit tier, which starts "
               f"none: it is not unit-tier. Give it @pytest.mark.processes (tests/_tiers.py), "
               f"or make it start no process (ranks as threads: tests/_threads.py).")
        self.started.append(msg)
        import pytest
        raise pytest.fail.Exception(msg, pytrace=False)

    def _patch(self, owner, name, what):
        real = getattr(owner, name, None)
        if real is None:
            return
        guard = self

        @functools.wraps(real)
        def refused(*a, **k):
            if guard.nodeid is None or threading.current_thread() in guard._before:
                return real(*a, **k)
            guard._refuse(what, a)
        self._saved.append((owner, name, real))
        setattr(owner, name, refused)

    def install(self) -> None:
        import multiprocessing.process
        import subprocess
        main = threading.main_thread()
        self._before = {t for t in threading.enumerate() if t is not main}
        for name in PROCESS_FUNCTIONS:
            self._patch(os, name, f"os.{name}")
        self._patch(subprocess.Popen, "_execute_child", "subprocess.Popen")
        self._patch(multiprocessing.process.BaseProcess, "start", "a multiprocessing Process")

    def uninstall(self) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()
        self._before = set()
