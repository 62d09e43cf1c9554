"""Where the broker's CPU goes by thread during one drain of the peers benchmark: ``python -m bench.threads
[--mode durable|default|memory] [--messages N]``.

The drain is ``bench.peers``'s (one publisher and 8 consumers in processes of their own, batches of 100,
``broker.client``) against a fresh ``broker serve``: ``durable`` journals and answers publishes and
settles after the fsync, ``default`` journals with ``durable: false`` queues, ``memory`` runs
``--in-memory``. Printed: the drain's rate and, for each thread of the server that used CPU meanwhile
(the main thread runs the event loop; of the others, the busy one in a durable drain is the journal's
writer), its user and system CPU per message from ``/proc/<pid>/task/<tid>/stat``. The server's whole
CPU per message is ``bench.peers``'s server column; this splits it. Bounded by the peers benchmark's
own budget; the server is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.peers import runner, servers

_TICKS = os.sysconf("SC_CLK_TCK")


def per_thread(pid: int) -> dict[tuple[str, str], tuple[float, float]]:
    """CPU seconds, user and system, of each live thread of ``pid``: ``(tid, name) → (user, system)``."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        found[(tid, name)] = (int(fields[11]) / _TICKS, int(fields[12]) / _TICKS)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("durable", "default", "memory"), default="durable")
    parser.add_argument("--messages", type=int, default=runner.SCALES["full"]["messages"])
    args = parser.parse_args(argv)
    counts = dict(runner.SCALES["full"], messages=args.messages)
    with servers.broker(durable_server=args.mode != "memory") as instance:
        address = dict(instance.address)
        address["queue_config"] = runner.BROKER_QUEUE["durable" if args.mode == "durable" else "default"]
        address["broker_client"] = "client"
        before = per_thread(instance.pid)
        drained = runner.drain("broker", instance, address, counts)
        after = per_thread(instance.pid)
        server_pid = instance.pid
    messages = drained["messages"]
    print(
        f"{args.mode}: {messages:,} messages, {drained['drain_per_second']:,.0f} msg/s drained, server CPU "
        f"{drained['server_cpu_us_per_message']:.1f} µs/msg"
    )
    for key, (user, system) in sorted(after.items()):
        was_user, was_system = before.get(key, (0.0, 0.0))
        used_user, used_system = user - was_user, system - was_system
        if used_user + used_system > 0:
            tid, name = key
            role = "main (event loop)" if tid == str(server_pid) else name
            print(
                f"  thread {tid:>7} {role:<18} user {used_user / messages * 1e6:6.1f} µs/msg"
                f"  system {used_system / messages * 1e6:6.1f} µs/msg"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
