"""The package layout is the architecture (docs/design.md, "Layout"): no import from a lower layer to a
higher one, the engine knows nothing of Triton, text or benchmarks, and the driver loads no model code
unless it runs a worker in its own process."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# package -> packages its modules may import at module level (besides itself and the standard library).
# orca.tuning (the measured thresholds) imports nothing from orca, so every layer may import it.
ALLOWED = {
    "orca.core": {"orca.config", "orca.sampling_params", "orca.checkpoint", "orca.executor", "orca.tuning"},
    "orca.frontend": {"orca.config", "orca.sampling_params", "orca.structured_outputs_params", "orca.checkpoint",
                      "orca.core", "orca.executor", "orca.tuning"},
    "orca.executor": {"orca.config", "orca.sampling_params", "orca.checkpoint", "orca.core.plan", "orca.parallel",
                      "orca.tuning"},
    "orca.tuning": set(),
}
NEVER_FROM_ORCA = ("orca_triton", "orca_client", "orca_openai", "orca_server", "triton_python_backend_utils")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> list[str]:
    """Modules imported at module level (not inside functions: those load only where they run)."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_no_layer_imports_a_higher_one() -> None:
    wrong = []
    for path in sorted((ROOT / "orca").rglob("*.py")):
        mod = module_name(path)
        for imported in top_level_imports(path):
            if imported.split(".")[0] in NEVER_FROM_ORCA:
                wrong.append(f"{mod} imports {imported}")
            for package, allowed in ALLOWED.items():
                if within(mod, package) and within(imported, "orca") and not within(imported, package):
                    if not any(within(imported, a) for a in allowed):
                        wrong.append(f"{mod} imports {imported}")
    for path in sorted((ROOT / "orca_openai").rglob("*.py")):
        wrong += [f"{module_name(path)} imports {i}" for i in top_level_imports(path) if within(i, "orca_client.bench")]
    assert wrong == []


def test_the_driver_loads_no_model_code() -> None:
    """`import orca` and an engine core's front end import neither the models nor the worker: only an
    in-process worker (or a worker process) does."""
    code = (
        "import sys, orca, orca.frontend.output_processor, orca.core.engine_loop\n"
        "print(sorted(m for m in sys.modules if m.startswith(('orca.models', 'orca.worker'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_worker_package_only_re_exports() -> None:
    """orca/worker/__init__.py defines nothing: its docstring, imports from its modules and __all__ (each
    concern is a module of its own: worker.py, resolution.py, runners.py, memory.py, warmup.py, draft.py,
    pipeline.py)."""
    body = ast.parse((ROOT / "orca" / "worker" / "__init__.py").read_text()).body
    defined = []
    for i, node in enumerate(body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and node.module and within(node.module, "orca.worker"):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        defined.append(ast.dump(node)[:80])
    assert defined == []


def test_the_models_know_nothing_of_the_runners() -> None:
    """orca/models/ (layers, attention backends, model families) imports nothing from the worker, where the
    runners are (eager, CUDA graphs, CPU graphs), at any level, and never asks whether it is being compiled:
    a runner gives a layer what it calls (a metadata object, a matmul), the layer does not choose by mode."""
    wrong = []
    for path in sorted((ROOT / "orca" / "models").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and within(node.module, "orca.worker"):
                wrong.append(f"{module_name(path)} imports {node.module}")
            elif isinstance(node, ast.Import):
                wrong += [f"{module_name(path)} imports {a.name}" for a in node.names if within(a.name, "orca.worker")]
            elif isinstance(node, ast.Attribute) and node.attr in ("is_compiling", "is_dynamo_compiling"):
                wrong.append(f"{module_name(path)} asks {node.attr}")
    assert wrong == []
