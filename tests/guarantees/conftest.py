"""Fixtures of the randomized guarantee tests."""
from __future__ import annotations

import pytest

from chaoshelpers import Cluster


@pytest.fixture
def cluster_factory(tmp_path):
    """``make(url, kind, faults, p, rng)``: a :class:`chaoshelpers.Cluster` of ``kind``
    (``chaos`` or ``soak``) worker processes, each killed at teardown."""
    made = []

    def make(url, kind, faults, p, rng):
        c = Cluster(tmp_path, url, kind, faults, p, rng)
        made.append(c)
        return c
    yield make
    for c in made:
        c.cleanup()
