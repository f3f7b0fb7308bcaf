"""Fuzz properties of the keyspace codecs (the decoders of stored values): fed arbitrary
bytes, arbitrary msgpack structures and mutations of valid encodings (bytes appended,
flipped, cut), a decoder returns a value or raises ``CorruptValue``, never another
exception (a damaged record must be recognisable as one: ``fdq.ops.queue``
dead-letters it and goes on). Derandomized and small: they run in every ``make test``."""
from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fdq.errors import CorruptValue
from fdq.keyspace import codec
from fdq.keyspace.codec import LeaseRecord, Record

FUZZ = settings(derandomize=True, max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 64 - 1), st.floats(allow_nan=True),
                     st.text(max_size=20), st.binary(max_size=20))
_structures = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=10), st.dictionaries(st.one_of(st.text(max_size=8), st.integers(0, 2 ** 62)), inner, max_size=5)),
    max_leaves=30)


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


_records = st.builds(
    Record, ts_ms=st.integers(0, 2 ** 62), shard_key=st.one_of(st.none(), st.text(max_size=12)),
    msg_id=st.one_of(st.none(), st.text(max_size=12)),
    headers=st.one_of(st.none(), st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)),
    body=st.binary(max_size=40), attempts=st.integers(0, 50), nchunks=st.integers(0, 3),
    replay_of=st.one_of(st.none(), st.text(max_size=12)), due=st.one_of(st.none(), st.integers(0, 2 ** 62)))


def _valid_encodings():
    lease = codec.encode_leases(b"L" * 16, "consumer-1", 30_000,
                                [b"v" * 12, Record(1, "k", body=b"x").encode(), 0, b"w" * 12, Record(2).encode(), 3])
    return st.one_of(
        _records.map(Record.encode), st.just(lease),
        st.builds(codec.encode_dead, _records.map(Record.encode), st.text(max_size=30),
                  st.one_of(st.none(), st.text(max_size=10)), st.integers(0, 2 ** 62), st.integers(0, 2 ** 62),
                  st.booleans()),
        st.builds(lambda ts, shard: b"s" * 10 + codec._DEDUPE.pack(1, ts, shard),
                  st.integers(0, 2 ** 62), st.integers(0, 2 ** 31)),
        st.builds(codec.encode_pending, st.integers(0, 1000)),
        st.builds(codec.encode_replay, st.dictionaries(st.text(max_size=6), st.integers(0, 2 ** 62), max_size=4)),
        st.builds(lambda c: codec.encode_subscription({"config": c}),
                  st.dictionaries(st.text(max_size=6), st.integers(0, 2 ** 62), max_size=4)))


@st.composite
def _mutated(draw):
    """A valid encoding with bytes appended, flipped or cut off."""
    raw = bytearray(draw(_valid_encodings()))
    how = draw(st.sampled_from(["append", "flip", "truncate"]))
    if how == "append":
        raw += draw(st.binary(min_size=1, max_size=8))
    elif how == "flip":
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] ^= draw(st.integers(1, 255))
    else:
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    return bytes(raw)


stored_values = st.one_of(st.binary(max_size=64), _structures.map(_pack), _mutated())

DECODERS = {
    "Record.decode": Record.decode,
    "decode_columns": lambda raw: codec.decode_columns([raw, Record(1, "k", body=b"ok").encode()]),
    "has_chunks": codec.has_chunks,
    "decode_leases": lambda raw: codec.decode_leases(b"key", raw),
    "lease_entries_hint": codec.lease_entries_hint,
    "LeaseRecord.delivered": lambda raw: [LeaseRecord(b"l", "c", 1, []).delivered([b"v" * 12, raw, 0])],
    "decode_dead": codec.decode_dead,
    "decode_dedupe": codec.decode_dedupe,
    "decode_marker": lambda raw: codec.decode_marker(raw, lambda: [b"\x01\x02"]),
    "decode_pending": codec.decode_pending,
    "decode_replay": codec.decode_replay,
    "decode_subscription": codec.decode_subscription,
    "unpack": codec.unpack,
}


@FUZZ
@given(stored_values)
def test_every_decoder_returns_a_value_or_raises_corrupt_value(raw):
    for name, decode in DECODERS.items():
        try:
            decode(raw)
        except CorruptValue as e:
            assert e.what and str(e), name
        except Exception as e:      # noqa: BLE001 - the property: nothing else
            raise AssertionError(f"{name}({raw!r}) raised {type(e).__name__}: {e}") from e


@FUZZ
@given(_records)
def test_a_record_decodes_as_encoded(rec):
    back = Record.decode(rec.encode())
    assert back == rec
    cols = codec.decode_columns([rec.encode()])
    assert (cols[0][0], cols[1][0], cols[4][0]) == (rec.ts_ms, rec.shard_key, rec.body)


@FUZZ
@given(_records.map(Record.encode), st.integers(1, 3))
def test_a_damaged_record_never_decodes_with_the_wrong_field_types(raw, flips):
    """Whatever a decoded record holds, its fields have their types (a body that is not
    bytes, a count that is not an int, would fail far from the read)."""
    damaged = bytearray(raw)
    for i in range(flips):
        damaged[(i * 7) % len(damaged)] ^= 0x5A
    try:
        rec = Record.decode(bytes(damaged))
    except CorruptValue:
        return
    assert type(rec.ts_ms) is int and type(rec.body) is bytes and type(rec.attempts) is int
    assert type(rec.nchunks) is int and rec.shard_key is None or type(rec.shard_key) is str
    assert rec.headers is None or type(rec.headers) is dict
