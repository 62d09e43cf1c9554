"""The broker's benchmark suite: ``python -m bench [GROUP ...] [--quick]``.

Groups (each bounded in count and time, each stopping by itself):

* ``core``: the pure queue core's publish, claim and ack throughput (a fresh process per repetition).
* ``depth``: claim+ack cost per message at 1,000 vs 1,000,000 ready messages.
* ``memory``: resident memory per ready message at 1,000,000 messages.
* ``http``: end-to-end drain over HTTP (1 publisher, 8 consumers) and publish rate alone.
* ``latency``: single-message claim round trip, p50 and p99.
* ``longpoll``: how fast a publish wakes a parked long-poll claim.
* ``policies``: in process, claim-window cohorts (16 claimers: rate and fairness of the shares) and a
  dead-letter-heavy run (every message nacked to exhaustion into ``.dlq``, checked to arrive exactly once).

Not part of ``all`` (the default): ``floor``, the HTTP stack's own CPU cost per request without the
broker (a calibration); ``regression``, the ``core`` figures on the current code against an older commit
(``--against``, default the core issue's last), alternating, as checked ratios; and ``profile``, one
extra HTTP drain sampled by py-spy with a summary of where the server's CPU time goes.

Every figure is the median of several repetitions. The run prints one table (measured, target,
pass/fail) and writes everything, repetitions included, to ``bench/results/<UTC timestamp>.json``.
See docs/benchmarks.md for the method and the latest figures.
"""
