"""Brokers take part in every topic's maintenance (``fdq.Maintenance``): a topic nobody
consumes is trimmed by its retention; one broker at a time; another takes over from a
broker killed with ``kill -9``; ``--no-maintenance`` keeps a broker out."""
import signal
import time

import fdq
from fdqtest import wait_for


def log_count(sup, name) -> int:
    c = sup.stats(name)["counters"]
    return c["inserted"] - c["trimmed"]


def holder(sup, name):
    return sup.stats(name)["maintenance"]["holder"]


def test_brokers_trim_a_topic_one_at_a_time_and_take_over_after_kill9(broker_factory, db, sup):
    sup.create_topic("t", retention_messages=5)
    a, b = broker_factory(), broker_factory()
    pids = {a.proc.pid: a, b.proc.pid: b}
    for i in range(20):
        assert a.http_req("/pub?topic=t", b"m%d" % i)[0] == 200
    wait_for(lambda: log_count(sup, "t") <= 5, 30, what="the brokers trimming topic t")
    first = wait_for(lambda: holder(sup, "t"), 30, what="a holder")
    # a broker's name: host-pid-random
    killed = pids[int(first.rsplit("-", 2)[1])]
    killed.stop(signal.SIGKILL)
    t0 = time.monotonic()
    second = wait_for(lambda: (h := holder(sup, "t")) not in (None, first) and h, 40, what="the other taking over")
    assert time.monotonic() - t0 < 35      # the lease (10 s) and a tick, on a busy machine
    assert int(second.rsplit("-", 2)[1]) != killed.proc.pid
    other = b if killed is a else a
    for i in range(20):
        assert other.http_req("/pub?topic=t", b"n%d" % i)[0] == 200
    wait_for(lambda: log_count(sup, "t") <= 5, 40, what="the survivor trimming")


def test_a_broker_with_no_maintenance_never_holds_it(broker_factory, db, sup):
    sup.create_topic("t", retention_messages=5)
    br = broker_factory("--no-maintenance")
    for i in range(20):
        assert br.http_req("/pub?topic=t", b"m%d" % i)[0] == 200
    with fdq.Maintenance(db, name="witness", topics=["t"]):     # a candidate that takes a free role
        wait_for(lambda: holder(sup, "t") == "witness", 30, what="the witness holding the free role")
        wait_for(lambda: log_count(sup, "t") <= 5, 30, what="the witness trimming")
