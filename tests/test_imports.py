"""The package's imports go one way: no module imports itself back, directly or through others.

Every module under ``ulysses_jax/`` (and, for cycles, ``benchmarks/``) is parsed with
``ast``; each ``import`` anywhere in it (at the top or inside a function) is an edge to the
module it names. ``from a import x`` points at ``a.x`` when that is a module, at ``a``
otherwise, and also at the module ``a``'s ``__init__`` took ``x`` from when it re-exports it.
The parent packages that Python runs first (``ulysses_jax/__init__.py`` for every submodule)
are not edges: a package's ``__init__`` always finishes importing before its submodules do.

The edges stay where they are: gin is imported only under ``ulysses_jax.cli`` (the command
lines), and ``gpus.GPUS`` is the one table of GPUs.
"""

import ast
import importlib
import pathlib
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "ulysses_jax"
ATTENTION = f"{PACKAGE}.attention"


def module_files(root=ROOT, package=PACKAGE):
  """Module name -> path of every ``.py`` file in ``package``."""
  files = {}
  for path in sorted((root / package).rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return files


def reexports(path, modules):
  """Name -> module it comes from, for each ``from m import name`` at the top of ``path``."""
  found = {}
  for node in ast.parse(path.read_text(), str(path)).body:
    if isinstance(node, ast.ImportFrom) and not node.level and node.module in modules:
      found.update({alias.asname or alias.name: node.module for alias in node.names})
  return found


def imports(name, path, modules):
  """``(imported module, imported names)`` for every import of a package module in ``path``;
  a name a package's ``__init__`` re-exports also counts as an import of its own module."""
  is_package = path.name == "__init__.py"
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found += [(alias.name, ()) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = name.split(".")[:len(name.split(".")) - node.level + is_package]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.append((sub, ()) if sub in modules else (base, (alias.name,)))
        if sub not in modules and base in modules and modules[base].name == "__init__.py":
          origin = reexports(modules[base], modules).get(alias.name)
          found += [(origin, ())] if origin else []
  return [(module, names) for module, names in found if module in modules]


def import_graph(root=ROOT, packages=(PACKAGE,)):
  modules = {}
  for package in packages:
    modules.update(module_files(root, package))
  return {name: sorted({m for m, _ in imports(name, path, modules)})
          for name, path in modules.items()}


def cycles(graph):
  """One shortest cycle through each module that lies on a cycle (deduplicated)."""
  found = {}
  for start in sorted(graph):
    parents, frontier = {}, [start]
    while frontier and start not in parents:
      nxt = []
      for node in frontier:
        for succ in graph[node]:
          if succ not in parents:
            parents[succ] = node
            nxt.append(succ)
      frontier = nxt
    if start in parents:
      path, node = [start], parents[start]
      while node != start:
        path.append(node)
        node = parents[node]
      found.setdefault(frozenset(path), [start] + path[:0:-1] + [start])
  return list(found.values())


def private_attention_imports(root=ROOT):
  """Imports of underscore names from ``ulysses_jax.attention`` by modules outside it."""
  modules = module_files(root)
  private = []
  for name, path in modules.items():
    if name == ATTENTION or name.startswith(f"{ATTENTION}."):
      continue
    for module, names in imports(name, path, modules):
      if module == ATTENTION or module.startswith(f"{ATTENTION}."):
        if any(part.startswith("_") for part in module.split(".") + list(names)):
          private.append(f"{name} imports {', '.join(names) or module} from {module}")
  return private


def test_checks_find_a_function_level_cycle_and_a_private_import(tmp_path):
  package = tmp_path / PACKAGE
  (package / "attention").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "attention" / "__init__.py").write_text("")
  (package / "attention" / "a.py").write_text("from ulysses_jax.attention.b import f\n")
  (package / "attention" / "b.py").write_text(
      "def f():\n  from ulysses_jax.attention import a\n")
  (package / "leaf.py").write_text("import ulysses_jax.attention.b\n")
  graph = import_graph(tmp_path)
  assert graph[f"{PACKAGE}.leaf"] == [f"{ATTENTION}.b"]
  assert cycles(graph) == [[f"{ATTENTION}.a", f"{ATTENTION}.b", f"{ATTENTION}.a"]]
  assert private_attention_imports(tmp_path) == []
  (package / "leaf.py").write_text("from .attention.b import _g\n")
  assert private_attention_imports(tmp_path) == [
      f"{PACKAGE}.leaf imports _g from {ATTENTION}.b"]


def test_a_reexported_name_is_an_edge_to_its_module(tmp_path):
  package = tmp_path / PACKAGE
  (package / "sub").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "sub" / "__init__.py").write_text("from ulysses_jax.sub.impl import f\n")
  (package / "sub" / "impl.py").write_text("def f():\n  pass\n")
  (package / "user.py").write_text("from ulysses_jax.sub import f, g\n")
  assert import_graph(tmp_path)[f"{PACKAGE}.user"] == [f"{PACKAGE}.sub", f"{PACKAGE}.sub.impl"]


def test_package_and_benchmarks_import_graph_has_no_cycle():
  found = cycles(import_graph(packages=(PACKAGE, "benchmarks")))
  assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_kernels_import_nothing_above_them():
  """The kernels are the lowest layer: the checks they need live beside them
  (``kernels.variants``), not in ``attention``."""
  graph = import_graph()
  upward = {name: [m for m in edges if m.startswith(f"{ATTENTION}") or m == PACKAGE]
            for name, edges in graph.items() if name.startswith(f"{PACKAGE}.kernels")}
  assert not any(upward.values()), {k: v for k, v in upward.items() if v}


def test_the_top_level_holds_the_shared_layers_only():
  """Subsystems live in subpackages (data/, hf/, attention/, ...); at most 18 loose modules."""
  loose = sorted(p.stem for p in (ROOT / PACKAGE).glob("*.py") if p.stem != "__init__")
  assert len(loose) <= 18, f"{len(loose)} top-level modules: {loose}"


def test_common_is_the_leaf_of_attention():
  imported = [m for m in import_graph()[f"{ATTENTION}.common"] if m.startswith(ATTENTION)]
  assert not imported, f"{ATTENTION}.common imports {imported}"


@pytest.mark.parametrize("module,other", [("ulysses", "ring"), ("ring", "ulysses")])
def test_plain_ulysses_and_ring_know_nothing_of_each_other(module, other):
  """The hybrid is built on top of both; neither imports it or the other."""
  imported = set(import_graph()[f"{ATTENTION}.{module}"])
  forbidden = {f"{ATTENTION}.{m}" for m in (other, "hybrid")}
  assert not imported & forbidden, f"{ATTENTION}.{module} imports {sorted(imported & forbidden)}"


def test_only_public_attention_names_are_imported_from_outside():
  private = private_attention_imports()
  assert not private, "\n".join(private)


CLI = f"{PACKAGE}.cli"


def gin_importers(root=ROOT):
  """Modules of the package that import gin (the package or any of its modules)."""
  found = []
  for name, path in module_files(root).items():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
               else [])
      if any(n == "gin" or n.startswith("gin.") for n in names):
        found.append(name)
        break
  return found


def test_gin_is_read_only_by_the_command_lines():
  """The library takes config objects; only ``ulysses_jax.cli`` turns gin files into them."""
  outside = [m for m in gin_importers() if not (m == CLI or m.startswith(f"{CLI}."))]
  assert not outside, f"gin imported outside {CLI}: {outside}"
  assert f"{CLI}.gin_config" in gin_importers()


def test_the_gin_check_finds_an_import_inside_a_function(tmp_path):
  package = tmp_path / PACKAGE
  (package / "cli").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "cli" / "__init__.py").write_text("import gin\n")
  (package / "leaf.py").write_text("def f():\n  from gin import config\n")
  assert gin_importers(tmp_path) == [f"{PACKAGE}.cli", f"{PACKAGE}.leaf"]


def test_one_gpu_table():
  """``gpus.GPUS`` is the only table of GPUs: no other module defines a dict named like it."""
  tables = []
  for name, path in module_files().items():
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        tables += [name for t in targets if isinstance(t, ast.Name) and t.id == "GPUS"]
  assert tables == [f"{PACKAGE}.gpus"], tables


def test_moved_modules_keep_their_old_names_for_one_release():
  """``ulysses_jax.data``, ``ulysses_jax.hf`` and ``ulysses_jax.grain_data`` were modules before
  0.2: their names still resolve, with a DeprecationWarning naming the new home."""
  from ulysses_jax import data, hf  # pylint: disable=import-outside-toplevel
  from ulysses_jax.data import pipeline  # pylint: disable=import-outside-toplevel
  from ulysses_jax.hf import weights  # pylint: disable=import-outside-toplevel
  with pytest.warns(DeprecationWarning, match=r"ulysses_jax\.data\.pipeline\.DataConfig"):
    assert data.DataConfig is pipeline.DataConfig
  with pytest.warns(DeprecationWarning, match=r"ulysses_jax\.hf\.weights\.load_llama"):
    assert hf.load_llama is weights.load_llama
  with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
    _ = data.no_such_name
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the new submodules import without a warning
    from ulysses_jax.data import corpus  # noqa: F401  pylint: disable=import-outside-toplevel
  sys.modules.pop(f"{PACKAGE}.grain_data", None)
  with pytest.warns(DeprecationWarning, match=r"ulysses_jax\.data\.grain_dataset"):
    old = importlib.import_module(f"{PACKAGE}.grain_data")
  assert old.GrainDataset is importlib.import_module(f"{PACKAGE}.data.grain_dataset").GrainDataset

