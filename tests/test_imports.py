"""No import circles in meshkern/ and orchestration/: every import counts, the ones inside
functions too (a lazy import hides a circle from Python, not from the design)."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("meshkern", "orchestration")
# Circles accepted for now (none: keep it that way).
KNOWN: list[set[str]] = []


def _modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [owner(f"{node.module}.{a.name}") or owner(node.module) for a in node.names]
            else:
                continue
            graph[m] |= {t for t in targets if t and t != m}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    found = circles(import_graph())
    new = [c for c in found if not any(c <= k for k in KNOWN)]
    assert not new, f"import circles: {[sorted(c) for c in new]}"


def test_the_checker_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


# orchestration/'s layout: the entry points (and the Trainer) on top, everything else in a
# package named for what it holds (docs/architecture.md has one line per package).
ENTRY_POINTS = {"train", "trainer", "evaluate", "export", "torchrun"}
MAX_MODULE_LINES = 450


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """orchestration's import graph one level up: a node per package or top-level module."""
    def top(m: str) -> str | None:
        parts = m.split(".")
        return parts[1] if parts[0] == "orchestration" and len(parts) > 1 else None

    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if (p := top(m)) is not None:
            out.setdefault(p, set()).update(q for d in deps if (q := top(d)) not in (None, p))
    return out


def test_no_circles_between_orchestration_packages():
    found = circles(package_graph(import_graph()))
    assert not found, f"package circles in orchestration/: {[sorted(c) for c in found]}"


def test_orchestration_top_level_holds_only_entry_points():
    top = os.path.join(ROOT, "orchestration")
    modules = {f[:-3] for f in os.listdir(top) if f.endswith(".py") and f != "__init__.py"}
    assert modules == ENTRY_POINTS, f"put {sorted(modules - ENTRY_POINTS)} into the package of its concern"
    for d in os.listdir(top):
        path = os.path.join(top, d)
        if os.path.isdir(path) and d != "__pycache__":
            assert os.path.isfile(os.path.join(path, "__init__.py")), f"orchestration/{d} is not a package"


def test_no_orchestration_module_is_over_the_size_limit():
    big = {}
    for name, path in _modules().items():
        if name.startswith("orchestration"):
            with open(path) as f:
                n = sum(1 for _ in f)
            if n > MAX_MODULE_LINES:
                big[name] = n
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split out the second job): {big}"


def test_the_package_graph_lifts_module_imports():
    g = {"orchestration.a.x": {"orchestration.b.y", "orchestration.a.z"}, "orchestration.a.z": set(),
         "orchestration.b.y": {"meshkern.k"}, "orchestration.train": {"orchestration.a"}, "meshkern.k": set()}
    assert package_graph(g) == {"a": {"b"}, "b": set(), "train": {"a"}}


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_reachability_follows_arrows():
    assert _reaches({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}, "a") == {"b", "c"}


def test_elastic_sits_below_the_trainer_and_the_launchers():
    """What runs inside a replica (orchestration/elastic/) never reaches up to the Trainer,
    the launchers or the entry points: they use it, not the other way round."""
    pkgs = package_graph(import_graph())
    assert not _reaches(pkgs, "elastic") & {"trainer", "launch", "train"}, _reaches(pkgs, "elastic")
    assert not _reaches(pkgs, "trainer") & {"launch", "train"}, "the Trainer must not know how it was launched"


def _calls(name: str) -> set[str]:
    """The orchestration modules that call ``name(...)`` (a bare name or an attribute)."""
    out = set()
    for mod, path in _modules().items():
        if not mod.startswith("orchestration"):
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                if (isinstance(fn, ast.Name) and fn.id == name) or (isinstance(fn, ast.Attribute) and fn.attr == name):
                    out.add(mod)
    return out


def test_one_rank_entry():
    """Every way a run starts reaches a rank through orchestration.launch.rank.run_rank: it
    alone builds a Trainer or runs an anchor rank."""
    assert _calls("Trainer") == {"orchestration.launch.rank"}
    assert _calls("run_anchor_rank") == {"orchestration.launch.rank"}
    assert _calls("exit_code") <= {"orchestration.launch.local", "orchestration.launch.torchrun",
                                   "orchestration.launch.elastic"}


def test_the_trainer_loop_names_no_launch_or_fault_tolerance_mode():
    """Trainer.step and Trainer.run call the step gate the same way in every mode: no name
    of a mode (elastic, quorum, heal, commit, torchrun, incarnation) in their code."""
    path = os.path.join(ROOT, "orchestration", "trainer.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    words = ("elastic", "quorum", "heal", "torchrun", "incarnation", "lighthouse", "replica_id")
    for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in ("step", "run")):
        names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | \
                {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
        named = sorted(x for x in names for w in words if w in x.lower())
        assert not named, f"Trainer.{fn.name} names {named}: put it behind the step gate"
