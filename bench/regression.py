"""``python -m bench regression [--against REV] [--current REV]``: the core benchmark (``bench.core``'s
publish, claim and ack throughput, 200,000 messages in batches of 100) on the current code and on an
older commit, in the same run, in lockstep.

Each side's ``broker/`` package is copied into a temporary directory of its own. The older one comes from
``git archive REV broker``, which is read-only for the repository (no worktree, no checkout, nothing left
in .git to clean up). The current one is copied from the working tree when the group starts, so that
edits others make during the run do not leak into later repetitions; or, with ``--current REV``, it too
comes from a commit.

Each repetition starts one fresh interpreter per side, ``python -m bench.regression MESSAGES ROOT``,
whose working directory is that side's copy, so ``import broker`` finds the copy first (the working
directory is ``sys.path[0]``; the editable install's finder comes after every path entry), while
``bench`` is found on ``PYTHONPATH`` as the checkout's current benchmark code, the same for both sides.
Each child checks where ``broker`` came from, builds its batches and queue (``bench.core.ThroughputRun``)
and then runs one phase when told to, while the other one waits. The two sides take turns phase by phase,
the order flipping at every phase (before/current, current/before, ...): the two measurements of a
phase are a second or so apart, so the drift of this VM's speed, which moves by tens of percent over
tens of seconds, hits both alike. Each phase is measured exactly as the ``core`` group measures it.

A row per operation reports the median over repetitions of the ratio current / before of the two
measurements taken side by side, checked against the issue's bound: policies may not cost the plain
path more than 10% (ratio ≥ 0.90). The checked rows compare messages per CPU second of the timed steps
(``per_cpu_second``): the cost of the code, which leaves out the time a process spent waiting for a CPU
that other processes held. An info row per operation compares the wall-clock rates the core group
reports; on a quiet machine the two agree, on a busy one the wall-clock ratios scatter by ±50% between
repetitions while the CPU-time ones stay within a few percent.

The benchmark code is today's ``bench.core``: a later change to it that uses a newer broker API makes
the older side fail (an error row) rather than silently measure something else.
"""

from __future__ import annotations

import hashlib
import io
import os
import select
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import orjson

from bench.child import REPO, ChildFailed
from bench.core import BATCH, THROUGHPUT
from bench.report import Result, failed, median, repetitions

#: The core issue's last commit: the figures the policies must not fall more than 10% below.
BASELINE = "4023255"
RATIO_TARGET = 0.90
PAIRS = {"full": 7, "quick": 3}
PHASES = ("publish", "claim", "ack")
#: Bounds on one child: building its batches and queue, and running one phase (then it is killed).
SETUP_TIMEOUT = 300.0
PHASE_TIMEOUT = 120.0


def git(*args: str) -> bytes:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def export_commit(rev: str, into: Path) -> str:
    """Write ``broker/`` as of ``rev`` under ``into``; return the full commit id."""
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    archive = git("archive", "--format=tar", commit, "broker")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return commit


def export_working_tree(into: Path) -> None:
    shutil.copytree(REPO / "broker", into / "broker", ignore=shutil.ignore_patterns("__pycache__"))


def tree_digest(root: Path) -> str:
    """A short digest of the ``.py`` files under ``root/broker``: tells two copies apart in the JSON."""
    digest = hashlib.sha256()
    for path in sorted((root / "broker").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


class Side:
    """One side's child process for one repetition: started at once, then driven a phase at a time."""

    def __init__(self, name: str, root: Path, messages: int, log_dir: Path) -> None:
        self.name = name
        self.root = root
        self.log_path = log_dir / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        with self.log_path.open("wb") as log:  # a file, not a pipe: the child can never block on it
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bench.regression", str(messages), str(root)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=root,
                env=env,
            )

    def answer(self, timeout: float) -> dict[str, Any]:
        """The child's next JSON line, within ``timeout`` seconds."""
        stdout = self.process.stdout
        assert stdout is not None
        readable, _, _ = select.select([stdout], [], [], timeout)
        line = stdout.readline() if readable else b""
        if not line:
            self.close()
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:]
            raise ChildFailed(
                f"the {self.name} side ({self.root}) did not answer within {timeout:g} s or exited "
                f"{self.process.returncode}: {' '.join(tail)}"
            )
        answer: dict[str, Any] = orjson.loads(line)
        return answer

    def run(self, phase: str) -> dict[str, Any]:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(phase.encode() + b"\n")
        stdin.flush()
        return self.answer(PHASE_TIMEOUT)

    def close(self) -> None:
        """Wait briefly for the child to exit (it does after its last phase); kill it otherwise."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def lockstep_repetition(roots: dict[str, Path], messages: int, first: int, log_dir: Path) -> dict[str, Any]:
    """Both sides once, phase by phase; ``first`` picks which side goes first in the first phase."""
    sides = [Side(name, root, messages, log_dir) for name, root in roots.items()]
    try:
        for side in sides:
            ready = side.answer(SETUP_TIMEOUT)
            if not Path(ready["broker"]).is_relative_to(side.root.resolve()):
                raise ChildFailed(f"the {side.name} side imported broker from {ready['broker']}")
        figures: dict[str, dict[str, Any]] = {side.name: {} for side in sides}
        for index, phase in enumerate(PHASES):
            order = sides if (first + index) % 2 == 0 else sides[::-1]
            for side in order:
                figures[side.name][phase] = {**side.run(phase), "order": order.index(side)}
        return figures
    finally:
        for side in sides:
            side.close()


def lockstep_child(messages: int, expect_root: str) -> None:
    """The child's side: check where ``broker`` comes from, prepare, then run each phase when told."""
    import broker

    location = Path(broker.__file__).resolve()
    if not location.is_relative_to(Path(expect_root).resolve()):
        raise RuntimeError(f"broker was imported from {location}, not from {expect_root}")
    from bench.core import ThroughputRun

    run = ThroughputRun(messages)
    sys.stdout.write(orjson.dumps({"broker": str(location)}).decode() + "\n")
    sys.stdout.flush()
    for phase in PHASES:
        asked = sys.stdin.readline().strip()
        if asked != phase:
            raise RuntimeError(f"asked for {asked!r}, expected {phase!r}")
        sys.stdout.write(orjson.dumps(getattr(run, phase)()).decode() + "\n")
        sys.stdout.flush()


def run_regression(scale: str, against: str = BASELINE, current: str | None = None) -> list[Result]:
    """``current`` ``None``: the working tree's ``broker/``; else the commit it names."""
    messages = THROUGHPUT[scale]["messages"]
    label = "current" if current is None else current
    names = [f"core {phase}: {label} / {against}, per CPU second (batches of {BATCH})" for phase in PHASES]
    with tempfile.TemporaryDirectory(prefix="broker-bench-regression-") as tmp:
        before_root, after_root = Path(tmp) / "before", Path(tmp) / "current"
        try:
            commit = export_commit(against, before_root)
            if current is None:
                current_commit = None
                export_working_tree(after_root)
            else:
                current_commit = export_commit(current, after_root)
        except Exception as exc:
            return [failed("regression", name, "ratio", f"{type(exc).__name__}: {exc}") for name in names]
        roots = {"before": before_root, "current": after_root}
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "current": []}
        try:
            for repetition in repetitions(PAIRS[scale]):
                figures = lockstep_repetition(roots, messages, repetition, Path(tmp))
                for side in runs:
                    runs[side].append(figures[side])
        except Exception as exc:
            return [failed("regression", name, "ratio", f"{type(exc).__name__}: {exc}") for name in names]
        digests = {side: tree_digest(root) for side, root in roots.items()}
    head = git("rev-parse", "--short", "HEAD").decode().strip()
    dirty = bool(git("status", "--porcelain", "--", "broker").strip())
    common = {
        "messages": messages,
        "against": against,
        "against_commit": commit,
        "current": current_commit or "working tree",
        "head": head,
        "broker_dirty": dirty,
        "broker_digests": digests,
    }
    results = []
    for phase, name in zip(PHASES, names, strict=True):
        wall_name = f"core {phase}: {label} / {against}, wall clock (batches of {BATCH})"
        for figure, row_name, target in (
            ("per_cpu_second", name, RATIO_TARGET),
            ("per_second", wall_name, None),
        ):
            before = [run[phase][figure] for run in runs["before"]]
            after = [run[phase][figure] for run in runs["current"]]
            details: dict[str, Any] = {
                **common,
                "figure": figure,
                "before": before,
                "current": after,
                "before_median": median(before),
                "current_median": median(after),
            }
            if target is not None:
                details["before_runs"] = [run[phase] for run in runs["before"]]
                details["current_runs"] = [run[phase] for run in runs["current"]]
            ratios = [now / then for then, now in zip(before, after, strict=True)]
            details["ratio_of_medians"] = median(after) / median(before)
            results.append(
                Result(
                    "regression",
                    row_name,
                    median(ratios),
                    "ratio",
                    target,
                    samples=ratios,
                    details=details,
                )
            )
    return results


if __name__ == "__main__":
    lockstep_child(int(sys.argv[1]), sys.argv[2])
