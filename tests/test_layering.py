"""The packages' dependency rules, read from every import statement (those inside functions
too; docs/ARCHITECTURE.md): the agent runs on a DPU's Arm cores, so it never imports the host
client, the DMA engine or the NIC stand-in (it starts them as processes), the kernels, CuPy
or torch (its contracts with the other parties are all in ``dpu_offload``);
the host client talks to the agent and the NIC only through the contracts, never by importing
them; the DMA engine and the NIC stand for hardware and import neither side (nor each other;
the NIC no CUDA: it writes rings in host memory); the kernels and the contracts import
neither side either, and the contracts import no CuPy or torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULES = {
    "dpu_agent": {"host_client", "dma_engine", "nic", "gpu_kernels", "cupy", "torch", "cupyx"},
    "host_client": {"dpu_agent", "nic"},
    "dma_engine": {"dpu_agent", "host_client", "nic", "torch"},
    "nic": {"dpu_agent", "host_client", "dma_engine", "cupy", "cupyx", "torch"},
    "gpu_kernels": {"dpu_agent", "host_client", "nic"},
    "dpu_offload": {"dpu_agent", "host_client", "gpu_kernels", "dma_engine", "nic", "cupy",
                    "torch", "cupyx"},
}


def imported(path: Path) -> dict[str, int]:
    """Top-level package -> the first line importing it, for every absolute import."""
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            out.setdefault(name.split(".")[0], node.lineno)
    return out


@pytest.mark.parametrize("package", sorted(RULES))
def test_a_package_imports_nothing_its_rule_forbids(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    broken = [f"{f.relative_to(ROOT)}:{line} imports {name}"
              for f in files for name, line in imported(f).items() if name in RULES[package]]
    assert not broken, "\n".join(broken)


CUPY_IMPORTERS = {"gpu_kernels/launch.py", "gpu_kernels/reference.py",
                  "host_client/worker.py", "dma_engine/backends.py"}
"""The only modules that import CuPy themselves (the rest use ``launch.cp``)."""


def test_only_the_named_modules_import_cupy() -> None:
    found = {str(f.relative_to(ROOT)) for package in RULES
             for f in (ROOT / package).rglob("*.py") if "cupy" in imported(f)}
    assert found == CUPY_IMPORTERS


def test_the_rules_see_a_forbidden_import(tmp_path: Path) -> None:
    """The scan finds imports in functions and ``from`` forms (so a passing rule means
    something)."""
    f = tmp_path / "m.py"
    f.write_text("import os\n\ndef g():\n    from dpu_agent.config import load\n"
                 "    import cupy.cuda as c\n")
    assert imported(f) == {"os": 1, "dpu_agent": 4, "cupy": 5}


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports (any form, anywhere in it; ``from P import m``
    counts module ``P.m`` where that is one)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        out.update(n for n in names if n in modules)
    return out


def test_no_import_cycle() -> None:
    """No module reaches itself through imports (TYPE_CHECKING and function-level ones
    included): collaborators take narrow protocols instead of importing the core."""
    files = {_module_of(f): f for package in RULES for f in (ROOT / package).rglob("*.py")
             if "v1" not in f.parts}
    graph = {m: _imports_of(f, set(files)) - {m} for m, f in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in graph[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, cycles


def test_the_agent_core_speaks_neither_its_service_layer_nor_protobuf() -> None:
    """``dpu_agent/service`` (gRPC, protobuf translation) sits above the core: only the entry
    points (``cli.py``, ``admin.py``) and the service layer import it or the generated
    protocol; the core speaks domain types (docs/ARCHITECTURE.md)."""
    above = {"dpu_agent.service", "dpu_offload.v1", "dpu_offload.v1.agent_pb2",
             "dpu_offload.v1.agent_pb2_grpc"} | {
        _module_of(f) for f in (ROOT / "dpu_agent" / "service").glob("*.py")}
    core = [f for f in (ROOT / "dpu_agent").rglob("*.py")
            if f.relative_to(ROOT / "dpu_agent").parts[0] not in ("service", "cli.py",
                                                                   "admin.py")]
    broken = {str(f.relative_to(ROOT)): sorted(found) for f in core
              if (found := _imports_of(f, above))}
    assert not broken, broken
