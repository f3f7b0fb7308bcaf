"""The worker processes of the tests: ``python tests/workers ROLE --url URL --name NAME
[--out FILE] [--status FILE] [role options]`` (``fdqtest.Procs`` starts them).

Each role is a real FDQ client in its own OS process, so a test can ``kill -9`` it.
Evidence is written where a crash cannot fake it: an ``O_APPEND`` line per event
(``common.Log``), or through the client's own transaction (exactly-once consumers).
The roles live in modules by what they drive: ``produce`` (producers), ``consume``
(consumers), ``operate`` (supervisor operations), ``chaos`` and ``soak`` (the
randomized guarantee tests); ``common`` holds what they share.
"""
from __future__ import annotations

import importlib
import sys

ROLES = {
    "producer": "produce", "push-ids": "produce", "spark-producer": "produce",
    "consumer": "consume", "subs-consumer": "consume", "tag-consumer": "consume", "web-consumer": "consume",
    "play": "operate", "rebalance": "operate", "replay": "operate", "trim": "operate",
    "jumper": "operate",
    "chaos-producer": "chaos", "chaos-consumer": "chaos", "chaos-supervisor": "chaos",
    "soak-producer": "soak", "soak-consumer": "soak", "soak-supervisor": "soak",
}


def main(argv):
    if not argv or argv[0] not in ROLES:
        sys.exit(f"usage: python tests/workers ROLE ... (ROLE: {', '.join(ROLES)})")
    module = importlib.import_module(ROLES[argv[0]])
    return module.main(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
