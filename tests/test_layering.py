"""Import layering: every import inside nlac_jax goes down the layer table of docs/ARCHITECTURE.md, never up or
sideways, so the package graph has no cycles and data flows one way (envs -> rl -> nlac -> runner).

Parsed with `ast` rather than imported, so a lazy import inside a function counts as much as a top-level one.
"""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "nlac_jax"

# The layers, bottom first. A unit is a package of nlac_jax (or, for planning/ and cli/, one of their modules). A
# module may import its own unit and the units of LOWER layers only.
LAYERS = (
    ("storage", "planning"),  # planning: its __init__ (notes only); its modules are ranked one by one below
    ("parallel", "observability", "testing", "text"),
    ("models",),
    ("sampling", "training", "planning.footprint", "planning.tpu_specs"),
    ("judges", "envs", "planning.iteration"),
    ("data", "rl"),
    ("nlac",),
    ("runner",),
    ("planning.planner",),
    ("cli",),
    ("experiments",),
    ("(entry points)",),  # nlac_jax/<command>.py: `python -m nlac_jax.<command>`
)
RANK = {u: i for i, layer in enumerate(LAYERS) for u in layer}
# package (or module) -> the packages it must never import, beyond what the layers already forbid
FORBIDDEN = {
    "rl/roles.py": ("nlac_jax.",),  # the role protocol is a leaf: rollouts drive it, NLAC implements it
}


def _unit(parts: tuple[str, ...]) -> str:
    """The layer unit of a module path inside nlac_jax ('runner', 'planning.planner', '(entry points)')."""
    if len(parts) == 1:
        return "(root)" if parts[0] in ("__init__.py", "__init__") else "(entry points)"
    head = parts[0]
    if head == "planning" and parts[1] not in ("", "__init__.py"):
        return f"{head}.{parts[1].removesuffix('.py')}"
    return "cli" if head == "cli" else head


def _imports(path: pathlib.Path) -> list[str]:
    """Every module name `path` imports (`from nlac_jax import nlac` counts as `nlac_jax.nlac`)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _files(where: str) -> list[pathlib.Path]:
    p = PKG / where
    return [p] if p.is_file() else sorted(p.rglob("*.py"))


def _layer_violations() -> list[str]:
    bad = []
    for f in _files("."):
        rel = f.relative_to(PKG).parts
        src = _unit(rel)
        for name in _imports(f):
            parts = name.split(".")
            if parts[0] != "nlac_jax" or len(parts) == 1:
                continue
            dst = _unit(tuple(parts[1:]) if len(parts) > 2 else (parts[1], ""))
            if dst in ("(root)", src) or src == "(root)" and dst == "storage":  # the root sets up storage first
                continue
            if dst == "(entry points)":
                bad.append(f"{f.relative_to(PKG.parent)} imports the command module {name}")
            elif dst not in RANK or src not in RANK:
                bad.append(f"{f.relative_to(PKG.parent)} -> {name}: {src if src not in RANK else dst} is in no layer")
            elif RANK[dst] >= RANK[src]:
                bad.append(f"{f.relative_to(PKG.parent)} ({src}) imports {name} ({dst}): not a lower layer")
    return bad


def test_imports_go_down_the_layers():
    bad = _layer_violations()
    assert not bad, "\n".join(bad)


def test_every_package_is_in_a_layer():
    units = {_unit(f.relative_to(PKG).parts) for f in _files(".")} - {"(root)"}
    assert units <= set(RANK), sorted(units - set(RANK))


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_upstream_modules_do_not_import_downstream_ones(where):
    files = _files(where)
    assert files, f"nothing to check under nlac_jax/{where}"
    bad = [f"{f.relative_to(PKG.parent)} imports {name}" for f in files for name in _imports(f)
           if any(name == x or name.startswith(x if x.endswith(".") else x + ".") for x in FORBIDDEN[where])]
    assert not bad, "\n".join(bad)


def test_the_check_sees_both_import_forms(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from nlac_jax import nlac\n    import nlac_jax.nlac.targets\n")
    assert {"nlac_jax.nlac", "nlac_jax.nlac.targets"} <= set(_imports(f))


# modules that deserialise by running code: nothing a process reads (weights, checkpoints, what its peers send)
# may go through them (safetensors, JSON and orbax only)
UNSAFE_SERIALISERS = ("pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal")


def test_no_module_imports_pickle_or_its_kin():
    bad = [f"{f.relative_to(PKG.parent)} imports {name}" for f in _files(".") for name in _imports(f)
           if name.split(".")[0] in UNSAFE_SERIALISERS]
    assert not bad, "\n".join(bad)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the nlac_jax modules it imports anywhere (a function-level import counts); `from P import m`
    points at the submodule m when there is one, else at P."""
    def name(f: pathlib.Path) -> str:
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    mods = {name(f): f for f in _files(".")}
    graph = {}
    for m, f in mods.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods:
                out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                        for a in node.names}
        graph[m] = out - {m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop(); on.discard(x); comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_module_import_cycles():
    assert _cycles(_module_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
