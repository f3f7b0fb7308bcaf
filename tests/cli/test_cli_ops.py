"""An operator's sequences: retention options, trim's messages, consumers shown as
they are (a killed one is not "live")."""
from __future__ import annotations

import fdq


def test_trim_of_a_topic_with_retention_bytes_only_does_not_say_it_has_no_retention(run, db, sup):
    sup.create_topic("sized", retention_bytes=1)
    fdq.Producer(db).push_many("sized", [fdq.Envelope(b"a" * 100)] * 3)
    r = run("trim", "sized", "--json")
    assert "no retention" not in r.stderr, r.stderr
    assert '"deleted": 3' in r.stdout
    sup.create_topic("unlimited")
    assert "has no retention: give --before" in run("trim", "unlimited").stderr
