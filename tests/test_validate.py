import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prep.base.errors import InputError
from prep.schema import validate
from prep.schema.measurements import stable_key

T0 = 1_700_000_000


def table(rows, **types):
    cols = list(zip(*rows))
    names = ["event_time", "prb_id", "src_addr", "dst_addr", "ip_version", "rtt"]
    default = {"event_time": pa.int64(), "prb_id": pa.int64(), "src_addr": pa.string(),
               "dst_addr": pa.string(), "ip_version": pa.int8(), "rtt": pa.float64()}
    default.update(types)
    return pa.table({n: pa.array(c, default[n]) for n, c in zip(names, cols)})


GOOD = [(T0, 7, "192.168.1.2", "193.0.14.129", 4, 12.5),
        (T0 + 1, None, "2001:db8::1", "2001:7fd::1", 6, -1.0)]
BAD = [
    (None, 1, "10.0.0.1", "1.1.1.1", 4, 1.0),          # missing_timestamp
    (T0 * 1000, 1, "10.0.0.1", "1.1.1.1", 4, 1.0),     # time_out_of_range (ms read as s)
    (-1, 1, "10.0.0.1", "1.1.1.1", 4, 1.0),            # time_out_of_range (before 1970)
    (T0, 1, "", "1.1.1.1", 4, 1.0),                    # empty_src_addr
    (T0, 1, None, "1.1.1.1", 4, 1.0),                  # empty_src_addr
    (T0, 1, "10.0.0.256", "1.1.1.1", 4, 1.0),          # invalid_src_addr
    (T0, 1, "10.0.0.1", "", 4, 1.0),                   # empty_dst_addr
    (T0, 1, "10.0.0.1", "k.root", 4, 1.0),             # invalid_dst_addr
    (T0, 1, "10.0.0.1", "1.1.1.1", 5, 1.0),            # bad_ip_version
    (T0, 1, "10.0.0.1", "1.1.1.1", None, 1.0),         # bad_ip_version
    (T0, 1, "10.0.0.1", "2001:db8::2", 4, 1.0),        # family_mismatch
    (T0, 1, "10.0.0.1", "1.1.1.1", 6, 1.0),            # family_mismatch
    (T0, 1, "10.0.0.1", "1.1.1.1", 4, float("nan")),   # bad_rtt
    (T0, 1, "10.0.0.1", "1.1.1.1", 4, float("inf")),   # bad_rtt
    (T0, 1, "10.0.0.1", "1.1.1.1", 4, -2.0),           # bad_rtt
    (T0, 1, "10.0.0.1", "1.1.1.1", 4, None),           # bad_rtt
    (T0, 1, "10.0.0.1", "1.1.1.1", 4, 1e12),           # rtt_out_of_range
    (T0, 1, "fe80::1%eth0", "fe80::2", 6, 1.0),        # invalid_src_addr (zone id)
    (T0, -3, "10.0.0.1", "1.1.1.1", 4, 1.0),           # bad_prb_id
    (None, 1, "", "x", 9, float("nan")),               # missing_timestamp (first reason wins)
]


def test_every_reason_counted_and_good_rows_exact():
    m, rejected = validate.validate_table(table(BAD[:8] + GOOD + BAD[8:]), source="t")
    assert rejected == {"missing_timestamp": 2, "time_out_of_range": 2, "empty_src_addr": 2,
                        "invalid_src_addr": 2, "empty_dst_addr": 1, "invalid_dst_addr": 1,
                        "bad_ip_version": 2, "family_mismatch": 2, "bad_rtt": 4,
                        "rtt_out_of_range": 1, "bad_prb_id": 1}
    assert len(m) + sum(rejected.values()) == len(BAD) + len(GOOD)
    assert m.probe.tolist() == [7, stable_key("2001:db8::1")]
    assert m.time.tolist() == [T0, T0 + 1]
    assert m.family.tolist() == [4, 6] and m.family.dtype == np.uint8
    assert m.src_hi.tolist() == [0, 0x2001_0db8_0000_0000]
    assert m.src_lo.tolist() == [0xC0A8_0102, 1]
    assert m.dst_hi.tolist() == [0, 0x2001_07fd_0000_0000]
    assert m.dst_lo.tolist() == [0xC100_0E81, 1]
    assert m.rtt.tolist() == [12.5, -1.0]


@pytest.mark.parametrize("typ,values", [
    (pa.timestamp("s", tz="UTC"), [T0, T0 + 1]),
    (pa.timestamp("ms"), [T0 * 1000 + 999, (T0 + 1) * 1000]),
    (pa.timestamp("us", tz="Europe/Berlin"), [T0 * 10**6, (T0 + 1) * 10**6 + 5]),
    (pa.timestamp("ns", tz="UTC"), [T0 * 10**9, (T0 + 1) * 10**9]),
    (pa.int32(), [T0, T0 + 1]),
    (pa.uint64(), [T0, T0 + 1]),
])
def test_timestamps_in_any_unit_become_unix_seconds(typ, values):
    rows = [(v, *r[1:]) for v, r in zip(values, GOOD)]
    m, rejected = validate.validate_table(table(rows, event_time=typ), source="t")
    assert rejected == {} and m.time.tolist() == [T0, T0 + 1]


def test_rtt_avg_alias_dictionary_strings_and_no_prb_id():
    t = table(GOOD).drop_columns(["prb_id"]).rename_columns(
        ["event_time", "src_addr", "dst_addr", "ip_version", "rtt_avg"])
    t = t.set_column(1, "src_addr", pc.dictionary_encode(t.column("src_addr")))
    m, rejected = validate.validate_table(t, source="t")
    assert rejected == {}
    assert m.probe.tolist() == [stable_key("192.168.1.2"), stable_key("2001:db8::1")]
    assert m.probe[0] >= 1 << 63
    assert m.rtt.tolist() == [12.5, -1.0]


def test_addresses_parse_each_text_once_and_give_the_kept_rows_words():
    """parse_addresses: per row the status (0 ok, 1 empty, 2 invalid) and family, per
    distinct text its words; ``words`` takes them for the rows asked (a mask or indices)."""
    col = pa.array(["10.0.0.1", None, "2001:db8::1", "10.0.0.1", "k.root", ""])
    cache = {}
    a = validate.parse_addresses(col, cache)
    assert a.status.tolist() == [0, 1, 0, 0, 2, 1]
    assert a.family.tolist() == [4, 0, 6, 4, 0, 0]
    assert sorted(t for t in cache if t) == ["10.0.0.1", "2001:db8::1", "k.root"]
    hi, lo = a.words(a.status == 0)
    assert hi.tolist() == [0, 0x2001_0DB8 << 32, 0]
    assert lo.tolist() == [0x0A00_0001, 1, 0x0A00_0001]
    assert [w.tolist() for w in a.words(np.array([3]))] == [[0], [0x0A00_0001]]
    assert len(a.words()[0]) == 6 and a.words()[0].dtype == np.uint64
    again = validate.parse_addresses(col, cache)  # from the cache: the same answers
    assert again.status.tolist() == a.status.tolist() and np.array_equal(again.lo_of, a.lo_of)


def test_missing_column_and_wrong_type_name_the_source():
    with pytest.raises(InputError, match=r"^a\.parquet: missing required column rtt "):
        validate.validate_table(table(GOOD).drop_columns(["rtt"]), source="a.parquet")
    with pytest.raises(InputError, match=r"^b: column ip_version has type string, expected an integer"):
        validate.validate_table(table([(T0, 1, "1.1.1.1", "1.1.1.1", "4", 1.0)], ip_version=pa.string()),
                                source="b")
    with pytest.raises(InputError, match=r"^c: column event_time has type string"):
        validate.validate_table(table([("2024-01-01", 1, "1.1.1.1", "1.1.1.1", 4, 1.0)],
                                      event_time=pa.string()), source="c")


def test_files_folders_batches_and_damaged_files(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    pq.write_table(table(GOOD + BAD), tmp_path / "d" / "e" / "b.parquet", row_group_size=5)
    pq.write_table(table(GOOD), tmp_path / "d" / "a.parquet")
    (tmp_path / "d" / "notes.txt").write_text("not data")
    (tmp_path / "d" / ".synth-tmp").mkdir()  # left by an interrupted run: not input
    pq.write_table(table(GOOD), tmp_path / "d" / ".synth-tmp" / "c.parquet")
    files = validate.list_inputs([tmp_path / "d"])
    assert files == [tmp_path / "d" / "a.parquet", tmp_path / "d" / "e" / "b.parquet"]
    batches = list(validate.iter_validated([tmp_path / "d"], batch_rows=4))
    # the addresses are read as dictionaries, one per row group (of 5): batches end every
    # 4 rows and where a group ends
    assert [(b.source.endswith("a.parquet"), b.rows_in) for b in batches] == [
        (True, 2), (False, 4), (False, 1), (False, 3), (False, 2), (False, 2), (False, 3),
        (False, 1), (False, 4), (False, 2)]
    for b in batches:
        assert b.rows_in == len(b.measurements) + sum(b.rejected.values())
    m, rejected, rows_in = validate.read_validated([tmp_path / "d"])
    assert rows_in == 24 and len(m) == 4 and sum(rejected.values()) == 20
    assert m.rtt.tolist() == [12.5, -1.0, 12.5, -1.0]

    bad = tmp_path / "trunc.parquet"
    bad.write_bytes((tmp_path / "d" / "a.parquet").read_bytes()[:-30])
    with pytest.raises(InputError, match=r"trunc\.parquet: not a readable parquet file"):
        list(validate.iter_validated([bad]))
    with pytest.raises(InputError, match=r"nope: no such file or folder"):
        validate.list_inputs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"empty: no \.parquet files found"):
        validate.list_inputs([tmp_path / "empty"])


ROW = st.tuples(
    st.one_of(st.none(), st.integers(0, 2**40), st.integers(T0 - 10**6, T0 + 10**6)),
    st.one_of(st.none(), st.integers(-5, 2**40)),
    st.sampled_from(["1.2.3.4", "::1", "", None, "zz", "300.1.1.1", "fe80::1"]),
    st.sampled_from(["8.8.8.8", "2001:db8::5", "", None, "::ffff:1.2.3.4", "a b"]),
    st.one_of(st.none(), st.sampled_from([4, 6, 0, 5])),
    st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.just(-1.0),
              st.floats(0, 1e4)),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(ROW, max_size=30))
def test_counts_always_add_up(rows):
    t = table(rows) if rows else table(GOOD).slice(0, 0)
    keep, m, rejected = validate.validate_rows(t, source="h")
    assert len(m) + sum(rejected.values()) == len(rows) == len(keep)
    assert set(rejected) <= set(validate.REASONS) and all(v > 0 for v in rejected.values())
    assert np.all((m.rtt == -1) | (m.rtt >= 0)) and set(m.family.tolist()) <= {4, 6}
    assert np.all(m.rtt <= validate.RTT_MAX_MS)
    assert np.all((m.time >= validate.TIME_MIN) & (m.time < validate.TIME_MAX))


def test_time_is_floor_seconds_and_the_range_is_1970_to_2100():
    # Floor, not truncation: half a second before 1970 is -1, out of range (truncated, 0 would pass).
    times = [dt.datetime(1969, 12, 31, 23, 59, 59, 500000), dt.datetime(1970, 1, 1),
             dt.datetime(2099, 12, 31, 23, 59, 59, 999999), dt.datetime(2100, 1, 1)]
    t = table([(x, *GOOD[0][1:]) for x in times], event_time=pa.timestamp("us"))
    m, rejected = validate.validate_table(t, source="t")
    assert m.time.tolist() == [0, 4_102_444_799] and rejected == {"time_out_of_range": 2}
