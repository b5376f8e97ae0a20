"""Import layering: data flows envs -> rl -> nlac, so upstream packages never import downstream ones.

Parsed with `ast` rather than imported, so a lazy import inside a function counts as much as a top-level one.
"""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "nlac_jax"

# package (or module) -> the packages it must never import
FORBIDDEN = {
    "rl": ("nlac_jax.nlac",),
    "envs": ("nlac_jax.rl", "nlac_jax.nlac"),
    "roles.py": ("nlac_jax.rl", "nlac_jax.nlac", "nlac_jax.envs"),
}


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


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_upstream_modules_do_not_import_downstream_ones(where):
    files = _files(where)
    assert files, f"nothing to check under nlac_jax/{where}"
    bad = [f"{f.relative_to(PKG.parent)} imports {name}" for f in files for name in _imports(f)
           if any(name == x or name.startswith(x + ".") for x in FORBIDDEN[where])]
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
