"""What a push must refuse, clearly and before it harms anything: bodies no transaction
can hold (large ones are split and reassembled), push_many batches too big for one
transaction, more messages than a versionstamp numbers, infinite delays, keys and ids
without UTF-8 form, bad input."""
from __future__ import annotations

import os

import pytest

import fdq
from fdq.keyspace import Keyspace
from fdq.keyspace.codec import CHUNK_BYTES

from fdqtest import FAST, fetch_until, scan


def test_a_body_the_config_allows_but_no_transaction_can_hold_is_refused_clearly(db):
    # max_message_bytes may be set up to 8 MiB, but a push writes the body to the log
    # and to every subscription's queue in one transaction (10 MB): a 6 MiB body must be
    # a MessageTooLarge naming why, not a raw transaction_too_large engine error.
    import os
    import pytest
    sup = fdq.Supervisor(db)
    sup.create_topic("big", shards=1, max_message_bytes=8 << 20)
    p = fdq.Producer(db)
    with pytest.raises(fdq.MessageTooLarge, match="subscription"):
        p.push("big", os.urandom(6 << 20))
    f = p.push_async("big", os.urandom(6 << 20))
    with pytest.raises(fdq.MessageTooLarge):
        f.result(60)
    body = os.urandom(4 << 20)
    p.push("big", body)
    assert sup.stats("big")["counters"]["inserted"] == 1


def test_more_messages_than_a_versionstamp_can_number_are_refused_clearly(db):
    # A message's id is its commit's versionstamp plus a 2-byte index in the
    # transaction: one transaction holds at most 65,536 messages. Beyond that, an
    # OverflowError escaped (not an FDQError); a max_batch beyond it broke every push.
    import pytest
    p = fdq.Producer(db)
    with pytest.raises(fdq.InvalidMessage, match="65,536"):
        p.push_many("t", [fdq.Envelope(b"x") for _ in range(65_537)])
    with pytest.raises(fdq.ConfigError, match="max_batch"):
        fdq.ProducerConfig(max_batch=100_000)
    assert fdq.ProducerConfig(max_batch=65_536).max_batch == 65_536


def test_an_infinite_delay_is_refused_at_the_call_and_fails_no_other_push(db):
    # delay=inf (or one whose milliseconds overflow a float) passed validation, then
    # raised OverflowError inside the group commit: every push of that transaction,
    # other callers' included, failed with it.
    import pytest
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=300))
    good = [p.push_async("t", b"ok%d" % i) for i in range(3)]
    for bad in (float("inf"), 1e307):
        with pytest.raises(fdq.InvalidMessage, match="delay"):
            p.push_async("t", b"bad", delay=bad).result(30)
    assert [f.result(30).topic for f in good] == ["t"] * 3


def test_a_shard_key_or_msg_id_without_utf8_form_is_refused_at_the_call(db):
    # A lone surrogate passed validation, then raised UnicodeEncodeError inside the
    # group commit: every other push of that transaction failed with it.
    import pytest
    fdq.Supervisor(db).create_topic("t", shards=2)
    p = fdq.Producer(db, config=fdq.ProducerConfig(linger_ms=300))
    good = [p.push_async("t", b"ok%d" % i, shard_key="clé", msg_id=f"ïd-{i}") for i in range(3)]
    for kw in (dict(msg_id="\ud800"), dict(shard_key="k\udc00")):
        with pytest.raises(fdq.InvalidMessage, match="UTF-8"):
            p.push_async("t", b"bad", **kw).result(30)
    assert [f.result(30).duplicate for f in good] == [False] * 3


def test_a_push_many_too_big_for_one_transaction_is_refused_clearly_and_harms_nothing(db):
    """A push_many within the documented message count (65,536) but over FDB's 10 MB
    per transaction failed with a raw engine error (transaction_too_large) that did not
    say which call or what to do; it is a MessageTooLarge naming both, nothing stored."""
    s = fdq.Supervisor(db)
    s.create_topic("t", shards=16)
    p = fdq.Producer(db)
    p.push("t", b"before", shard_key="k")
    for envs in ([fdq.Envelope(b"x" * 10, shard_key=f"k{i}") for i in range(65_536)],
                 [fdq.Envelope(os.urandom(1 << 20), shard_key="k") for _ in range(12)]):
        try:
            p.push_many("t", envs)
        except fdq.errors.MessageTooLarge as e:
            assert f"push_many of {len(envs):,} messages" in str(e) and "smaller batches" in str(e)
        else:
            raise AssertionError("push_many over 10 MB was not refused")
    assert s.stats("t")["counters"]["inserted"] == 1
    assert len(p.push_many("t", [fdq.Envelope(b"x" * 10, shard_key=f"k{i}") for i in range(1000)])) == 1000


def test_large_bodies_split_and_reassembled(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    bodies = [os.urandom(CHUNK_BYTES + 1), os.urandom(250_000), os.urandom(1 << 20)]
    for b in bodies:
        p.push("t", b, shard_key="big")
    with pytest.raises(fdq.MessageTooLarge, match="max_message_bytes"):
        p.push("t", os.urandom((1 << 20) + 1), shard_key="big")
    sup.create_topic("small", shards=1, max_message_bytes=200_000)
    with pytest.raises(fdq.MessageTooLarge):
        p.push("small", os.urandom(200_001))
    assert sup.stats("t")["counters"]["inserted"] == 3
    assert sup.stats("small")["counters"]["inserted"] == 0
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = fetch_until(c, lambda g: len(g) >= 3, 30)
        assert [m.body for m in got] == bodies
        for m in got:
            m.ack()
    ts = Keyspace().topic("t")
    assert scan(db, ts.subs["default"]["chunks"].key()) == []   # acked: chunks removed
    # The "all" log keeps the full bodies for replay.
    assert p.replay("t", 0) == 3


def test_bad_input_is_refused_clearly_and_harms_nothing(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2)
    p = fdq.Producer(db)
    stored = [f"m{i}".encode() for i in range(20)]
    p.push_many("t", [fdq.Envelope(b, shard_key="k") for b in stored])

    for name in ("bad name", "", "a" * 65, "x/y", "t#other", "ü", None, 42):
        with pytest.raises(fdq.InvalidName, match="invalid topic name"):
            p.push(name, b"x")
        with pytest.raises(fdq.InvalidName):
            sup.create_topic(name)
        with pytest.raises(fdq.InvalidName):
            fdq.tail(db, name, lambda m: None)
    with pytest.raises(fdq.InvalidName):
        fdq.Consumer(db, "t", subscription="no such/sub")
    for body in ("text", 42, None, {"a": 1}, [b"x"]):
        with pytest.raises(fdq.InvalidMessage, match="body must be bytes"):
            p.push("t", body)
        with pytest.raises(fdq.InvalidMessage):
            p.push_many("t", [fdq.Envelope(b"ok"), fdq.Envelope(body)])
    with pytest.raises(fdq.InvalidMessage, match="shard_key"):
        p.push("t", b"x", shard_key=5)
    with pytest.raises(fdq.InvalidMessage, match="shard_key of 1,025 bytes"):
        p.push("t", b"x", shard_key="k" * 1025)
    with pytest.raises(fdq.InvalidMessage, match="shard_key of 200,001 bytes"):
        p.push_many("t", [fdq.Envelope(b"ok"), fdq.Envelope(b"x", shard_key="é" * 100_000 + "k")])
    for cid in ("", "x" * 129, "a\nb", 7):
        with pytest.raises(fdq.ConfigError, match="consumer_id"):
            fdq.Consumer(db, "t", consumer_id=cid)
    with pytest.raises(fdq.InvalidMessage, match="delay"):
        p.push("t", b"x", delay=-1)
    with pytest.raises(fdq.MessageTooLarge):
        p.push_many("t", [fdq.Envelope(b"fine"), fdq.Envelope(b"x" * ((1 << 20) + 1))])
    with pytest.raises(fdq.TopicNotFound, match="nope"):
        sup.stats("nope")
    with pytest.raises(fdq.TopicNotFound):
        fdq.Consumer(db, "nope", create=False)
    with pytest.raises(fdq.ConfigError):
        fdq.tail(db, "t", lambda tr, m: None, transactional=True, acking=True)
    for e in (fdq.InvalidName, fdq.InvalidMessage, fdq.MessageTooLarge, fdq.TopicNotFound, fdq.BacklogFull):
        assert issubclass(e, fdq.FDQError)

    # Nothing already stored was harmed, nothing half-written, no stray topic.
    assert [n for n, _c in sup.topics()] == ["t"]
    assert sup.stats("t")["counters"]["inserted"] == 20
    with fdq.Consumer(db, "t", config=FAST) as c:
        got = fetch_until(c, lambda g: len(g) >= 20, 10)
        assert [m.body for m in got] == stored
        for m in got:
            m.ack()


@pytest.mark.parametrize("arg", [None, 5, object(), "abc", {"k": b"v"}, b"abc", bytearray(b"ab"),
                                 fdq.Envelope(b"one")])
def test_push_many_and_push_stream_refuse_what_is_not_an_iterable_of_messages(db, arg):
    """``push_many("t", None)`` raised TypeError ('NoneType' object is not iterable); a
    str, bytes or dict was iterated into characters, ints or keys, each refused as a
    body whose type named the wrong thing. Each is an InvalidMessage naming the call and
    what it takes, nothing pushed."""
    fdq.Supervisor(db).create_topic("t", shards=1)
    p = fdq.Producer(db)
    with pytest.raises(fdq.InvalidMessage, match=r"push_many takes an iterable of Envelope or bytes, not "):
        p.push_many("t", arg)
    with pytest.raises(fdq.InvalidMessage, match=r"push_stream takes an iterable of Envelope or bytes, not "):
        p.push_stream("t", arg)
    assert fdq.Supervisor(db).stats("t")["counters"]["inserted"] == 0
    assert [r.topic for r in p.push_many("t", (b"x" for _ in range(2)))] == ["t", "t"]
