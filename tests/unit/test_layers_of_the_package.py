"""The package's two layers, checked from its source: the library (influence_core) imports only torch and numpy, the
engine (influence_core.pipeline) sits above it, imports go one way and form no cycle, and module names are unique."""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("influence_core", "tasks", "flows")
ENGINE = "influence_core.pipeline"
# What the library must run without: the engine's and the orchestration's dependencies (and the layers above it).
BLOCKED = ("prefect", "zarr", "dask", "distributed", "s3fs", "fsspec", "faiss", "pydantic", "yaml", "sklearn", "matplotlib", "psutil", "safetensors", "tasks", "flows")


def module_name(path: Path) -> str:
    """Dotted name of a source file under ROOT (a package's __init__ is the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: str) -> dict[str, Path]:
    return {module_name(path): path for path in sorted((ROOT / package).rglob("*.py"))}


ALL_MODULES = {name: path for package in PACKAGES for name, path in modules(package).items()}
LIBRARY = {name: path for name, path in modules("influence_core").items() if name != ENGINE and not name.startswith(ENGINE + ".")}


def imports_of(name: str, path: Path) -> set[str]:
    """Every module a source file imports, anywhere in it (top level, functions, TYPE_CHECKING blocks), as absolute
    names; `from package import module` counts as the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in ALL_MODULES else source for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    """The imports between the project's own modules."""
    return {name: {target for target in imports_of(name, path) if target in ALL_MODULES and target != name} for name, path in ALL_MODULES.items()}


def test_library_imports_and_runs_without_the_engine_dependencies():
    """Every library module imports, and a fit and its scores match the closed form, in a process where the engine's
    and Prefect's packages cannot be imported (as if not installed)."""
    program = f"""
import sys
BLOCKED = {BLOCKED!r}
sys.modules.update(dict.fromkeys(BLOCKED))  # None in sys.modules: `import` raises ImportError, find_spec says absent
try:
    import zarr
except ImportError:
    pass
else:
    raise SystemExit("the blocker let zarr through")

import importlib
for name in {sorted(LIBRARY)!r}:
    importlib.import_module(name)

import torch
import torch.nn.functional as F
from torch import nn
from influence_core import CgInfluence, DirectInfluence

torch.manual_seed(0)
x, x_test = torch.randn(40, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
y, y_test = x @ torch.randn(4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
model = nn.Linear(4, 1, bias=False).double()
with torch.no_grad():
    model.weight.copy_(torch.linalg.lstsq(x, y[:, None]).solution.T)
half_mse = lambda out, target: 0.5 * F.mse_loss(out.squeeze(-1), target)
w, lam = model.weight.detach()[0], 1e-2
hessian = x.T @ x / len(x) + lam * torch.eye(4, dtype=x.dtype)
expected = ((x_test @ w - y_test)[:, None] * x_test) @ torch.linalg.solve(hessian, ((x @ w - y)[:, None] * x).T)
for method in (DirectInfluence, CgInfluence):
    scores = method(model, half_mse, lam).fit((x, y)).influences(x_test, y_test, x, y)
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-10)
leaked = sorted(m for m, module in sys.modules.items() if module is not None and m.partition(".")[0] in BLOCKED)
assert not leaked, leaked
print("library ok")
"""
    result = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "library ok"


def test_the_library_never_imports_the_engine():
    upward = {name: sorted(t for t in imports_of(name, path) if t == ENGINE or t.startswith(ENGINE + ".")) for name, path in LIBRARY.items()}
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_influence_core_never_imports_prefect_tasks_or_flows():
    """Imports go one way: flows -> tasks -> influence_core; the engine never imports prefect."""
    above = {"prefect", "tasks", "flows"}
    upward = {name: sorted(t for t in imports_of(name, path) if t.partition(".")[0] in above) for name, path in modules("influence_core").items()}
    assert {name: targets for name, targets in upward.items() if targets} == {}


def test_no_import_cycle():
    """The graph of imports between the project's modules (counting imports inside functions and TYPE_CHECKING
    blocks) is acyclic."""
    graph = import_graph()
    # the walk sees the edges it must: a relative import, a `from package import module`, an absolute one
    assert "influence_core.methods.scorer" in graph["influence_core.methods.influence_model"]
    assert "influence_core.pipeline.store.storage" in graph["influence_core.pipeline.store.stage"]
    assert "influence_core.pipeline.specs" in graph["tasks.stages"]
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
    assert set(order) == set(ALL_MODULES)


def test_no_import_is_deferred_past_the_code():
    """A module-level import placed after code (`# noqa: E402`) is how a cycle was once dodged; none remains."""
    assert [name for name, path in ALL_MODULES.items() if "noqa: E402" in path.read_text()] == []


def test_module_names_are_unique():
    """No two modules under influence_core share a file name, so a name says which module it is."""
    seen: dict[str, list[str]] = {}
    for name, path in modules("influence_core").items():
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(name)
    assert {stem: names for stem, names in seen.items() if len(names) > 1} == {}
