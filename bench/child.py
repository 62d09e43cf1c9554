"""Run one measurement in a fresh interpreter: ``python -m bench.child MODULE NAME JSON-KWARGS``.

The child looks up ``NAME`` in ``MODULE.CHILDREN``, calls it with the keyword arguments, and prints its
result as one JSON line on stdout. A fresh process per measurement keeps heaps and garbage-collector
state from one measurement out of the next.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent


class ChildFailed(RuntimeError):
    pass


def run_child(module: str, name: str, kwargs: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """Run ``module.CHILDREN[name](**kwargs)`` in a fresh interpreter; kill it after ``timeout`` s."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "bench.child", module, name, orjson.dumps(kwargs).decode()],
            capture_output=True,
            timeout=timeout,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        raise ChildFailed(f"{module}:{name} did not finish within {timeout:g} s (killed)") from None
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
        raise ChildFailed(f"{module}:{name} exited {done.returncode}: {' '.join(tail)}")
    result: dict[str, Any] = orjson.loads(done.stdout.splitlines()[-1])
    return result


def main(argv: list[str]) -> None:
    module, name, kwargs = argv
    function = importlib.import_module(module).CHILDREN[name]
    sys.stdout.write(orjson.dumps(function(**orjson.loads(kwargs))).decode() + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
