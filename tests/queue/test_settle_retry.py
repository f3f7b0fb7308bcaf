"""Leasing and settling are exact when commits come back with ``commit_unknown_result``:
a retried lease batch whose first attempt committed returns that batch (not a second one,
leaving the first invisible until its ack wait), and a retried settle whose first attempt
committed does not report its own leases as lost."""
from __future__ import annotations

import fdq
from fdq.errors import LeaseLost
from fdqtest import database_url, with_faults


def test_acks_under_commit_unknown_result_are_exact(tmp_path):
    url = database_url(tmp_path / "f.db")
    fdq.Supervisor(fdq.connect(url)).create_topic("t", shards=2)
    fdq.Producer(fdq.connect(url)).push_many("t", [fdq.Envelope(b"%d" % i) for i in range(300)])
    db = fdq.connect(with_faults(url, 0.3, 7))    # 1021 after ~30% of real commits
    lost, acked = [], set()
    with fdq.Consumer(db, "t", config=fdq.ConsumerConfig(ack_wait_s=60)) as c:
        for _ in range(200):
            msgs = c.fetch(20, timeout=0.2)
            if not msgs and len(acked) == 300:
                break
            try:
                c.ack_many(msgs)
            except LeaseLost as e:
                lost.append(str(e))
            acked.update(m.id for m in msgs)
    assert lost == []
    assert len(acked) == 300, "leased messages went missing (a retried lease took another batch)"
    st = fdq.Supervisor(fdq.connect(url)).stats("t")
    sub = st["subscriptions"]["default"]
    assert len(acked) == 300
    assert (sub["backlog"], sub["in_flight"], st["counters"]["acked"]) == (0, 0, 300)
