"""The broker side by side with the systems users would pick instead (issue 9): beanstalkd, Redis lists
and a PostgreSQL ``SKIP LOCKED`` table, on temporary servers on 127.0.0.1, doing the same work.

``python -m bench.peers [--quick]`` (``make bench-peers``). Modules: ``servers`` starts and stops the
temporary servers (installing missing ones from Debian's packages), ``clients`` holds one adapter per
system and the publisher, consumer and latency loops they share, ``runner`` runs one repeat of the set,
``summary`` computes medians, the broker's ratios and the table. docs/benchmarks.md ("Against other
brokers") describes each set-up and reads the figures.
"""
