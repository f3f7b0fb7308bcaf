"""Message headers on push: validated, stored exactly, tags and trace ids.

Header validation: names, values, reserved ## names, count and size limits. Every
refusal is an InvalidHeader naming the header, and leaves the database unchanged."""
from __future__ import annotations

import msgpack
import pytest

import fdq
from fdq.headers import DISPATCH_TAG, MAX_HEADER_BYTES, MAX_HEADERS, MAX_NAME_CHARS, TRACE_ID

from fdqtest import collect, wait_for


VALID = [
    ("simple", {"a": "b"}),
    ("all name characters", {"aZ09_-#x": 1}),
    ("one char", {"x": None}),
    ("longest name", {"n" * MAX_NAME_CHARS: True}),
    ("single # inside", {"a#b": False}),
    ("int bounds", {"lo": -2**63, "hi": 2**64 - 1}),
    ("float", {"f": 1.5, "g": -0.0}),
    ("unicode value", {"u": "héllo ☃ \u0000"}),
    ("list and map", {"l": [1, "two", [3.0, None]], "m": {"k": {"n": [True]}}}),
    ("empty containers", {"e": [], "d": {}, "s": ""}),
    ("dispatch tag", {DISPATCH_TAG: "tag-1_#x"}),
    ("trace id digits", {TRACE_ID: "12345"}),
    ("trace id any value", {TRACE_ID: "not-digits"}),
    ("max count", {f"h{i}": i for i in range(MAX_HEADERS)}),
    ("near max size", {"big": "x" * (MAX_HEADER_BYTES - 20)}),
]

# (case, headers, text the error must contain: the header's name or the limit)
INVALID = [
    ("empty name", {"": 1}, "''"),
    ("space in name", {"bad name": 1}, "'bad name'"),
    ("dot in name", {"a.b": 1}, "'a.b'"),
    ("newline after name", {"ok\n": 1}, "'ok\\n'"),
    ("non-ascii name", {"é": 1}, "'é'"),
    ("too long name", {"n" * (MAX_NAME_CHARS + 1): 1}, "n" * (MAX_NAME_CHARS + 1)),
    ("non-str name", {5: 1}, "5"),
    ("unknown reserved", {"##custom": 1}, "'##custom'"),
    ("reserved prefix only", {"##": 1}, "'##'"),
    ("bytes value", {"b": b"raw"}, "'b'"),
    ("set value", {"s": {1, 2}}, "'s'"),
    ("object value", {"o": object()}, "'o'"),
    ("nan", {"n": float("nan")}, "'n'"),
    ("inf in list", {"inf": [1, float("inf")]}, "'inf'"),
    ("int too big", {"i": 2**64}, "'i'"),
    ("int too small", {"i": -2**63 - 1}, "'i'"),
    ("non-str map key", {"m": {1: "x"}}, "'m'"),
    ("lone surrogate in value", {"s": "bad\udc80"}, "'s'"),
    ("lone surrogate in nested map key", {"m": {"k\udc80": 1}}, "'m'"),
    ("too deep", {"deep": [[[[[[[[[[1]]]]]]]]]]}, "'deep'"),
    ("tag not a string", {DISPATCH_TAG: 7}, DISPATCH_TAG),
    ("tag empty", {DISPATCH_TAG: ""}, DISPATCH_TAG),
    ("tag with space", {DISPATCH_TAG: "a b"}, DISPATCH_TAG),
    ("tag with newline", {DISPATCH_TAG: "a\n"}, DISPATCH_TAG),
    ("too many", {f"h{i}": i for i in range(MAX_HEADERS + 1)}, f"at most {MAX_HEADERS}"),
    ("too large", {"small": 1, "huge": "x" * MAX_HEADER_BYTES}, "'huge'"),
    ("not a mapping", [("a", 1)], "mapping"),
]


@pytest.fixture
def env(db):
    fdq.Supervisor(db).create_topic("ext", shards=2, extend=True)
    fdq.Supervisor(db).create_topic("plain", shards=2)
    p = fdq.Producer(db)
    p.push("ext", b"before")          # something already accepted, must stay
    return db, p


def _pack(v):
    return msgpack.packb(v, use_bin_type=True)


@pytest.mark.parametrize("case,headers", VALID, ids=[c for c, _ in VALID])
def test_valid_headers_are_stored_exactly(env, case, headers):
    db, p = env
    p.push("ext", b"body", headers=headers)
    with fdq.Consumer(db, "ext", extend_support=True) as c:
        got = {}
        for _ in range(20):
            for m in c.fetch(10, timeout=0.5):
                got[m.body] = m
                m.ack()
            if b"body" in got:
                break
    m = got[b"body"]
    assert dict(m.headers) == headers
    assert _pack(dict(m.headers)) == _pack(headers)        # types too: 1 vs 1.0, list vs map
    with pytest.raises(TypeError):
        m.headers["new"] = 1                               # read-only mapping


@pytest.mark.parametrize("case,headers,names", INVALID, ids=[c for c, _, _ in INVALID])
@pytest.mark.parametrize("how", ["push", "push_many", "envelope"])
def test_invalid_headers_refused_nothing_written(env, dump, case, headers, names, how):
    db, p = env
    before = dump()
    with pytest.raises(fdq.InvalidHeader) as e:
        if how == "push":
            p.push("ext", b"x", headers=headers)
        elif how == "push_many":    # one bad envelope: the whole batch is refused
            p.push_many("ext", [b"ok-1", fdq.Envelope(b"x", headers=headers)])
        else:
            fdq.Envelope(b"x", headers=headers)
    assert names in str(e.value)
    assert isinstance(e.value, fdq.FDQError)
    assert dump() == before


def test_headers_on_plain_topic_refused_in_transaction(env, dump):
    """The plain-topic check runs inside the push transaction: the other envelopes of
    the batch, and an auto-created topic, are not written either."""
    db, p = env
    before = dump()
    with pytest.raises(fdq.InvalidHeader, match="'plain' has no extend support"):
        p.push("plain", b"x", headers={"a": 1})
    with pytest.raises(fdq.InvalidHeader, match="no extend support"):
        p.push_many("plain", [b"fine", fdq.Envelope(b"x", headers={DISPATCH_TAG: "A"})])
    with pytest.raises(fdq.InvalidHeader, match="'auto-new' has no extend support"):
        p.push("auto-new", b"x", headers={"a": 1})          # auto-created topics are plain
    assert dump() == before
    assert [t for t, _c in fdq.Supervisor(db).topics()] == ["ext", "plain"]
    # No headers (or an empty mapping) is fine on a plain topic.
    p.push("plain", b"y", headers={})
    p.push("plain", b"z")
    assert fdq.Supervisor(db).stats("plain")["counters"]["inserted"] == 2


def test_counters_unchanged_by_refusals(env):
    db, p = env
    sup = fdq.Supervisor(db)
    before = sup.stats("ext")
    for _case, headers, _n in INVALID:
        with pytest.raises(fdq.InvalidHeader):
            p.push("ext", b"x", headers=headers)
    after = sup.stats("ext")
    assert after["counters"] == before["counters"] and after["counters"]["inserted"] == 1
    assert after["subscriptions"]["default"]["backlog"] == 1


def test_envelope_headers_are_a_copy():
    value = [1, 2]
    h = {"l": value}
    env = fdq.Envelope(b"x", headers=h)
    value.append(3)
    h["new"] = 1
    assert dict(env.headers) == {"l": [1, 2]}
    with pytest.raises(TypeError):
        env.headers["x"] = 1
    assert dict(fdq.Envelope(b"x", headers={"t": (1, (2,))}).headers) == {"t": [1, [2]]}   # stored as lists


def test_desired_tag_follows_the_tag_rule(db):
    fdq.Supervisor(db).create_topic("ext", extend=True)
    for bad in ("", "a b", 5, "a\n", "x" * (MAX_NAME_CHARS + 1)):
        with pytest.raises(fdq.ConfigError, match="desired_tag"):
            fdq.Consumer(db, "ext", extend_support=True, desired_tag=bad)
    assert fdq.Supervisor(db).stats("ext")["subscriptions"]["default"]["consumers"] == []


def test_known_names_still_get_every_check():
    """Names seen valid take a fast path: values, tags and sizes are still checked."""
    from fdq.headers import validate_headers
    validate_headers({"warm": 1, DISPATCH_TAG: "A", "f": 1.0})     # the names are now known
    for headers, text in [({"warm": 2**64}, "'warm'"), ({"warm": -2**63 - 1}, "'warm'"),
                          ({"f": float("nan")}, "'f'"), ({"f": float("-inf")}, "'f'"),
                          ({DISPATCH_TAG: "a b"}, DISPATCH_TAG), ({DISPATCH_TAG: 1}, DISPATCH_TAG),
                          ({"warm": "x" * MAX_HEADER_BYTES}, "'warm'"), ({"warm": b"x"}, "'warm'"),
                          ({"warm": [float("nan")]}, "'warm'")]:
        with pytest.raises(fdq.InvalidHeader) as e:
            validate_headers(headers)
        assert text in str(e.value), headers
    assert validate_headers({"warm": 2**64 - 1, "f": -1.5}) == {"warm": 2**64 - 1, "f": -1.5}


def test_push_many_mixing_tagged_and_untagged(db):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", shards=2, extend=True)
    p = fdq.Producer(db)
    envs = [fdq.Envelope(b"u0"),
            fdq.Envelope(b"a0", shard_key="x", headers={DISPATCH_TAG: "A"}),
            fdq.Envelope(b"b0", headers={DISPATCH_TAG: "B", TRACE_ID: "7"}),
            fdq.Envelope(b"u1", headers={"k": "v"}),
            fdq.Envelope(b"a1", shard_key="x", headers={DISPATCH_TAG: "A", "n": 2}),
            b"u2"]
    res = p.push_many("t", envs)
    assert [r.trace_id for r in res] == [None, None, "7", None, None, None]
    assert res[2].position == res[2].id and res[0].position is None
    assert len({r.id for r in res}) == 6 and sorted(r.id for r in res) == [r.id for r in res]
    tags = sup.stats("t")["subscriptions"]["default"]["tags"]
    assert {t: v["backlog"] for t, v in tags.items()} == {"": 3, "A": 2, "B": 1}
    a = fdq.Consumer(db, "t", extend_support=True, desired_tag="A", config=fdq.ConsumerConfig(heartbeat_interval_s=0.1, poll_interval_s=0.1))
    try:
        got_a = []
        wait_for(lambda: got_a.extend(a.fetch(10, timeout=0.2)) or len(got_a) >= 2, 30, "A's two messages")
        assert [m.body for m in got_a] == [b"a0", b"a1"]            # same shard key: in order
        assert [dict(m.headers) for m in got_a] == [{DISPATCH_TAG: "A"}, {DISPATCH_TAG: "A", "n": 2}]
        for m in got_a:
            m.ack()
    finally:
        a.close()
    got = collect(db, "t", 4, extend_support=True)
    assert sorted(m.body for m in got) == [b"b0", b"u0", b"u1", b"u2"]
    assert {m.body: m.tag for m in got}[b"b0"] == "B"


def test_trace_id(db, dump):
    sup = fdq.Supervisor(db)
    sup.create_topic("t", extend=True)
    p = fdq.Producer(db)
    r = p.push("t", b"x", headers={TRACE_ID: "000123"})
    assert r.trace_id == "000123" and r.position == r.id
    r = p.push("t", b"x", headers={TRACE_ID: 123})          # a JSON number: echoed as its digits
    assert r.trace_id == "123" and r.position == r.id
    for not_digits in ("12a", "", " 1", "１２", -1, 1.5, True, None, ["1"]):
        r2 = p.push("t", b"y", headers={TRACE_ID: not_digits})
        assert r2.trace_id is None and r2.position is None
    d1 = p.push("t", b"z", msg_id="m-1", headers={TRACE_ID: "9"})
    d2 = p.push("t", b"z", msg_id="m-1", headers={TRACE_ID: "9"})
    assert d2.duplicate and d2.position == d1.id == d1.position and d2.trace_id == "9"
    before = dump()
    with pytest.raises(fdq.InvalidHeader, match="'##trace'"):
        p.push("t", b"x", headers={"##trace": "1"})
    assert dump() == before
