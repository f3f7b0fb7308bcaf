"""A push of a msg_id already stored within the dedupe window writes nothing: it must be
answered as the duplicate it is, whatever the backlog (a producer retrying after
commit_unknown_result was told 'push refused' for a message that was stored)."""
from __future__ import annotations

import pytest

import fdq
from fdq.errors import BacklogFull


def test_a_duplicate_push_to_a_topic_over_its_max_backlog_is_answered_as_a_duplicate(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=1, max_backlog=2)
    p = fdq.Producer(db)
    first = p.push("t", b"a", msg_id="a")
    p.push("t", b"b")
    sup.update_topic("t", max_backlog=1)     # (or producers overshot it together)
    again = p.push("t", b"a", msg_id="a")
    assert again.duplicate and again.id == first.id
    [dup] = p.push_many("t", [fdq.Envelope(b"a", msg_id="a")])
    assert dup.duplicate and dup.id == first.id
    with pytest.raises(BacklogFull):          # a new message still is refused
        p.push("t", b"c", msg_id="c")
    with pytest.raises(BacklogFull):          # and so is a batch with one
        p.push_many("t", [fdq.Envelope(b"a", msg_id="a"), fdq.Envelope(b"d")])
    assert sup.stats("t")["counters"]["inserted"] == 2
