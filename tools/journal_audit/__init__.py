"""Journals into Spark (CONTRACT §9): a PySpark data source for the broker's journal, a Parquet export,
and an audit of the invariants. See docs/audit.md; ``python -m tools.journal_audit --help``.

Modules, in the order data flows through them:

* ``schema``: the fixed schema of the loader's DataFrame, one row per record;
* ``reading``: one segment file into rows (the broker's own decoder; no Spark);
* ``source``: the data source ``broker_journal`` (one partition per segment), the Parquet export;
* ``session``: a quiet SparkSession on any master;
* ``live``: the state the broker would recover (snapshot plus replay), for "still live", and its copy
  beside a Parquet export;
* ``walk``: one message's records checked against the invariants (no Spark);
* ``audit``: the whole audit in Spark, and its report.
"""
