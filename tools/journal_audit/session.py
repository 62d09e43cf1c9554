"""A SparkSession for the tools: quiet unless asked, loopback-only on a local master, and able to run
the broker's and the tools' Python code in its workers."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: The repository root: the directory that holds ``tools/`` and ``broker/``.
ROOT: Final = Path(__file__).resolve().parents[2]

#: Where a quiet session's JVM writes what it would have printed (its log, Spark's warnings).
_LOG_NAME: Final = "broker-journal-audit-spark.log"


def is_local(master: str) -> bool:
    return master == "local" or master.startswith("local[")


def spark_session(
    master: str = "local[*]",
    *,
    verbose: bool = False,
    app_name: str = "broker-journal-audit",
    shuffle_partitions: int | None = None,
    conf: dict[str, str] | None = None,
) -> SparkSession:
    """Start (or join) a SparkSession on ``master``.

    Quiet by default: the JVM's own start-up chatter on stderr goes to a log file in the temporary
    directory (``spark_log_path()``) and Spark's log level is ERROR; ``verbose`` keeps both on the
    terminal at WARN. On a ``local`` master everything binds to 127.0.0.1 and the UI is off. On another
    master the ``tools`` and ``broker`` packages are shipped to the executors as a zip (their
    dependencies, e.g. ``pip install cbor2 orjson``, must be installed there: see docs/audit.md).
    """
    from pyspark.sql import SparkSession

    # The workers run this interpreter (with the broker's dependencies) and find ``tools`` by path.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    local = is_local(master)
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
    )
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.driver.bindAddress", "127.0.0.1").config(
            "spark.driver.host", "127.0.0.1"
        )
        cores = _local_cores(master)
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions or max(2 * cores, 2)))
    elif shuffle_partitions:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    if verbose:
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
    else:
        with _stderr_to(spark_log_path()):
            spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
    if not local:
        spark.sparkContext.addPyFile(str(_code_zip()))
    return spark


def spark_log_path() -> Path:
    return Path(tempfile.gettempdir()) / _LOG_NAME


def _local_cores(master: str) -> int:
    inside = master[len("local[") : -1] if master.startswith("local[") else "1"
    if inside in ("*", ""):
        return os.cpu_count() or 1
    try:
        return max(int(inside.split(",")[0]), 1)
    except ValueError:
        return os.cpu_count() or 1


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Point file descriptor 2 at ``path`` while the JVM starts: the JVM (and Spark's Python workers it
    forks later) keep that as their stderr; this process gets its own stderr back afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _code_zip() -> Path:
    """``broker`` and ``tools`` as one zip, for ``addPyFile`` on a cluster."""
    target = Path(tempfile.mkdtemp(prefix="broker-journal-audit-")) / "broker_tools.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for package in ("broker", "tools"):
            for path in sorted((ROOT / package).rglob("*.py")):
                archive.write(path, path.relative_to(ROOT))
    return target
