"""``broker.core`` stays pure: importing it loads no event loop, web, storage, logging or codec library."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import broker.core

FORBIDDEN = ("trio", "quart", "quart_trio", "hypercorn", "lmdb", "structlog", "httpx", "cbor2")
CORE = pathlib.Path(broker.core.__file__).parent


def is_forbidden(module: str) -> bool:
    return module.split(".")[0] in FORBIDDEN


def test_importing_broker_core_loads_no_io_library() -> None:
    script = "import json, sys\nimport broker.core\nprint(json.dumps(sorted(sys.modules)))\n"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=CORE.parent.parent
    )
    loaded = json.loads(result.stdout)
    assert "broker.core.queue" in loaded  # the check saw a real import
    assert [module for module in loaded if is_forbidden(module)] == []


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module an ``import`` or ``from … import`` in ``path`` names, wherever it sits."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_core_module_imports_an_io_library() -> None:
    sources = sorted(CORE.rglob("*.py"))
    assert {path.name for path in sources} >= {"queue.py", "model.py", "records.py", "structures.py"}
    offenders = {
        str(path.relative_to(CORE)): sorted(name for name in imported_modules(path) if is_forbidden(name))
        for path in sources
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_core_imports_only_the_standard_library_and_the_broker() -> None:
    for path in sorted(CORE.rglob("*.py")):
        for name in imported_modules(path):
            top = name.split(".")[0]
            assert top == "broker" or top in sys.stdlib_module_names, f"{path.name} imports {name}"
            assert not name.startswith("broker.") or name.startswith(("broker.core", "broker.errors")), (
                f"{path.name} imports {name}, outside the pure layer"
            )


def test_the_detector_would_see_an_import(tmp_path: pathlib.Path) -> None:
    module = tmp_path / "sample.py"
    module.write_text(
        "import os\nif True:\n    import trio.lowlevel\nfrom cbor2 import dumps\nfrom . import x\n"
    )
    found = sorted(name for name in imported_modules(module) if is_forbidden(name))
    assert found == ["cbor2", "trio.lowlevel"]
