"""`prep synth`: realistic RIPE-Atlas-like ping measurements, the built-in data of `make shards`.

The model, numpy-vectorized and a pure function of the config (same seed, same bytes):

1. Probes get a stable prb_id, a location (mostly Europe, as in RIPE Atlas), a busyness
   drawn from a lognormal (a few very busy probes, many sparse ones), an IPv4 address
   (~40 % behind NAT: a private address shared with other probes, told apart by prb_id)
   and, for ~75 % of them, a global IPv6 address. 3 % of dual-stack probes have broken
   IPv6: every IPv6 ping fails.
2. Streams: each probe pings 3-7 root servers every 240 s (built-in measurements, msm_id
   1001+ for IPv4, 2001+ for IPv6, on both families when it can) plus Poisson(2 x busyness)
   user measurements to other targets every 60-3600 s (msm_id >= 10,000,000).
3. Rows are spread over streams by a multinomial on busyness x rate; a stream's rows are a
   contiguous run of its schedule (the probe was online then), a few seconds of jitter each.
4. RTT per (probe, target): distance (anycast roots: the nearest site) plus the probe's access
   delay, per-pair jitter, evening congestion, rare spikes and outliers: p50 ~48 ms, p99 ~300
   ms, a probe's RTTs sharing its place as real ones do. ~17 % of pings fail (rtt = -1).
5. ~0.1 % malformed rows as in the real data: empty src/dst address, ip_version not
   matching the addresses. `prep shards` rejects them by reason.

Output: DIR/YYYY-MM-DDTHH.parquet, one file per hour of data, columns event_time (whole
seconds; parquet has no second unit, so it reads back as timestamp[ms, UTC]), prb_id,
src_addr, dst_addr, ip_version (int8), rtt (float64 ms), msm_id, size; DIR is claimed,
staged and published by prep.jobs.parquet_out, as `prep import-atlas`'s output.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from prep.base.words import count
from prep.jobs.claim import claim

START = 1_767_225_600  # 2026-01-01T00:00:00Z
ROOTS_V4 = ["198.41.0.4", "170.247.170.2", "192.33.4.12", "199.7.91.13", "192.203.230.10",
            "192.5.5.241", "192.112.36.4", "198.97.190.53", "192.36.148.17", "192.58.128.30",
            "193.0.14.129", "199.7.83.42", "202.12.27.33"]
ROOTS_V6 = ["2001:503:ba3e::2:30", "2801:1b8:10::b", "2001:500:2::c", "2001:500:2d::d",
            "2001:500:a8::e", "2001:500:2f::f", "2001:500:12::d0d", "2001:500:1::53",
            "2001:7fe::53", "2001:503:c27::2:30", "2001:7fd::1", "2001:500:9f::42", "2001:dc3::35"]
NAT_POOL = ["192.168.1.2", "192.168.1.10", "192.168.0.2", "192.168.0.100", "192.168.178.20",
            "192.168.2.11", "10.0.0.2", "10.0.0.10", "10.1.1.5", "172.16.0.2", "192.168.88.253",
            "192.168.1.100"]
USER_TARGETS = 400
USER_INTERVALS = np.array([60, 120, 300, 900, 1800, 3600])
# Failures, drawn once per stream (probe, target, family): its rate FAIL_SCALE x
# Beta(*FAIL_BETA); FIREWALLED[0] of the user streams fail at FIREWALLED[1] instead; every
# IPv6 stream of a probe with broken IPv6 (V6_BROKEN of the dual-stack ones) fails
FAIL_BETA, FAIL_SCALE = (0.6, 4.0), 0.9
FIREWALLED = (0.12, 0.95)
V6_BROKEN = 0.03


@dataclass(frozen=True)
class SynthConfig:
    out: Path  # folder for the hourly parquet files
    rows: int = 3_000_000  # exact number of measurements written
    probes: int = 3_000  # probes (RIPE Atlas has ~12k)
    days: int = 2  # data spans this many days from 2026-01-01
    seed: int = 0
    overwrite: bool = False  # replace the parquet files already in out
    # Each probe's access delay (ms, lognormal median and sigma; 0 ms: none), added to every
    # RTT of its streams; the sigma of the per-stream routing detour (a lognormal factor);
    # and the most sites an anycast root has (0: a root's RTT is a draw per stream, not its
    # distance to the probe's nearest site). The defaults (2026-11-29) make a probe's replies
    # predict each other, as real ones do (docs/learning.md §8.12); access_ms=0, detour=0.35,
    # anycast_sites=0 is the world before, where nothing but the target predicts an RTT.
    access_ms: float = 8.0
    access_sigma: float = 1.1
    detour: float = 0.15
    anycast_sites: int = 30


def _locations(rng, n):
    """(lat, lon) in radians: 60 % Europe, 20 % North America, 20 % anywhere."""
    region = rng.choice(3, size=n, p=[0.6, 0.2, 0.2])
    lat = np.where(region == 0, rng.normal(50, 6, n), np.where(region == 1, rng.normal(40, 7, n),
                                                               rng.uniform(-45, 60, n)))
    lon = np.where(region == 0, rng.normal(10, 12, n), np.where(region == 1, rng.normal(-90, 20, n),
                                                                rng.uniform(-180, 180, n)))
    return np.radians(np.clip(lat, -80, 80)), np.radians(lon)


def _v4_public(rng, n):
    first = rng.choice([31, 37, 46, 62, 77, 78, 80, 81, 82, 84, 85, 87, 89, 91, 93, 94, 95, 109,
                        145, 176, 178, 185, 188, 193, 194, 195, 212, 213, 217], size=n)
    rest = rng.integers(0, 1 << 24, n)
    return [str(IPv4Address((int(f) << 24) | int(r))) for f, r in zip(first, rest)]


def _v6_global(rng, n):
    prefix = rng.choice([0x2a02, 0x2a01, 0x2001, 0x2003, 0x2600, 0x2a00, 0x2804, 0x2c0f], size=n)
    mid = rng.integers(0, 1 << 48, n, dtype=np.uint64)
    host = rng.integers(1, 1 << 62, n, dtype=np.uint64)
    return [str(IPv6Address((int(p) << 112) | (int(m) << 64) | int(h)))
            for p, m, h in zip(prefix, mid, host)]


def _anycast_rtt(rng, most: int, lat, lon, root, n_roots: int) -> np.ndarray:
    """Each (probe, root) stream's distance delay to the root's nearest site: root r has 2 to
    ``most`` sites, placed as probes are; 6 ms + 86 ms per radian, as to a user target."""
    out = np.full(len(root), np.inf)
    for r in range(n_roots):
        s_lat, s_lon = _locations(rng, int(rng.integers(2, max(most, 2) + 1)))
        mine = root == r
        cos = (np.sin(lat[mine, None]) * np.sin(s_lat) + np.cos(lat[mine, None]) * np.cos(s_lat)
               * np.cos(lon[mine, None] - s_lon))
        out[mine] = np.arccos(np.clip(cos, -1, 1)).min(axis=1)
    return 6 + out * 6371 * 0.0135


def _row_rtts(rng, t, lon, base, diurnal, jitter, fail_p) -> np.ndarray:
    """Each row's RTT (ms, 3 decimals; -1 failed) from its stream's: an evening peak by the
    probe's local hour, jitter, rare spikes and rarer outliers."""
    n = len(t)
    local_hour = (t / 3600.0 + np.degrees(lon) / 15.0) % 24
    evening = np.maximum(0.0, np.sin((local_hour - 12.0) / 12.0 * np.pi)) ** 2
    rtt = base * (1 + diurnal * evening) + jitter * rng.exponential(1.0, n)
    spike = rng.random(n)
    rtt = np.where(spike < 0.003, rtt * (2 + np.minimum(rng.pareto(1.5, n), 30)), rtt)
    rtt = np.where(spike < 2e-6, rng.uniform(1_000, 300_000, n), rtt)
    rtt = np.round(np.maximum(rtt, 0.1), 3)
    rtt[rng.random(n) < fail_p] = -1.0
    return rtt


def _malformed(rng, src, dst, ipv, empty: int):
    """~0.1 % malformed rows, as in real dumps: an empty source (pool index ``empty``), an
    empty destination, or the other family in ip_version."""
    bad = rng.random(len(src))
    src = np.where(bad < 0.0003, empty, src)
    dst = np.where((bad >= 0.0003) & (bad < 0.0006), empty, dst)
    ipv = np.where((bad >= 0.0006) & (bad < 0.001), 10 - ipv, ipv).astype(np.int8)
    return src, dst, ipv


def generate(cfg: SynthConfig) -> dict[str, np.ndarray | list]:
    """All rows as columns (sorted by time), plus the address pool they index into and each
    row's true failure rate, ``fail_p`` (its stream's; bench.fail_floor reads it)."""
    rng = np.random.default_rng(cfg.seed)
    P, N, span = cfg.probes, cfg.rows, cfg.days * 86_400
    prb_id = np.sort(rng.choice(np.arange(1, 1_200_000), size=P, replace=False)).astype(np.int64)
    p_lat, p_lon = _locations(rng, P)
    busy = rng.lognormal(0.0, 1.4, P)
    uptime = rng.beta(0.6, 0.6, P)  # sparse probes are the ones mostly offline
    dual = rng.random(P) < 0.75
    v6_broken = dual & (rng.random(P) < V6_BROKEN)
    nat = rng.random(P) < 0.4
    # Address pool: [probe v4 | probe v6 | NAT pool | root v4 | root v6 | user v4 | user v6 | ""].
    v4_public = _v4_public(rng, P)
    nat_pick = rng.integers(0, len(NAT_POOL), P)
    pool = (v4_public + _v6_global(rng, P) + NAT_POOL + ROOTS_V4 + ROOTS_V6
            + _v4_public(rng, USER_TARGETS) + _v6_global(rng, USER_TARGETS) + [""])
    R = len(ROOTS_V4)
    o_nat, o_root, o_user = 2 * P, 2 * P + len(NAT_POOL), 2 * P + len(NAT_POOL) + 2 * R
    p_src4 = np.where(nat, o_nat + nat_pick, np.arange(P))
    t_lat, t_lon = _locations(rng, USER_TARGETS)

    # Streams: built-in root pings (both families on dual-stack probes), then user ones.
    k_b = 3 + np.minimum(rng.poisson(2.0, P), 4)
    b_probe = np.repeat(np.arange(P), k_b)
    b_target = rng.integers(0, R, len(b_probe))
    b_six = np.zeros(len(b_probe), bool)
    both = dual[b_probe]
    b_probe, b_target = np.concatenate([b_probe, b_probe[both]]), np.concatenate([b_target, b_target[both]])
    b_six = np.concatenate([b_six, np.ones(both.sum(), bool)])
    k_u = np.minimum(rng.poisson(3.0 * busy), 120)
    u_probe = np.repeat(np.arange(P), k_u)
    u_target = rng.integers(0, USER_TARGETS, len(u_probe))
    u_six = dual[u_probe] & (rng.random(len(u_probe)) < 0.56)
    nb, nu = len(b_probe), len(u_probe)
    s_probe = np.concatenate([b_probe, u_probe])
    s_six = np.concatenate([b_six, u_six])
    s_builtin = np.arange(nb + nu) < nb
    s_interval = np.concatenate([np.full(nb, 240), rng.choice(USER_INTERVALS, nu, p=[.15, .1, .35, .2, .1, .1])])
    s_msm = np.concatenate([np.where(b_six, 2001, 1001) + b_target,
                            rng.integers(10_000_000, 100_000_000, nu)])
    s_size = np.concatenate([np.full(nb, 48), rng.choice([48, 64, 32, 1000], nu, p=[.5, .2, .2, .1])])
    s_src = np.where(s_six, P + s_probe, p_src4[s_probe])
    s_dst = np.concatenate([o_root + b_target + np.where(b_six, R, 0),
                            o_user + u_target + np.where(u_six, USER_TARGETS, 0)])

    # RTT per stream (= per probe, target, family): distance for user targets, anycast roots near.
    u_lat, u_lon = t_lat[u_target], t_lon[u_target]
    pl, po = p_lat[u_probe], p_lon[u_probe]
    arc = np.arccos(np.clip(np.sin(pl) * np.sin(u_lat) + np.cos(pl) * np.cos(u_lat) * np.cos(po - u_lon), -1, 1))
    base = np.concatenate([rng.lognormal(np.log(34), 0.9, nb), 6 + arc * 6371 * 0.0135])
    S = nb + nu
    base *= np.exp(cfg.detour * rng.standard_normal(S))  # routing detours: lognormal(0, detour)
    geo = np.random.default_rng([cfg.seed, 1])  # its own stream: without these, the same data
    if cfg.anycast_sites > 0:
        base[:nb] = _anycast_rtt(geo, cfg.anycast_sites, p_lat[b_probe], p_lon[b_probe],
                                 b_target, R) * np.exp(cfg.detour * geo.standard_normal(nb))
    if cfg.access_ms > 0:
        base += geo.lognormal(np.log(cfg.access_ms), cfg.access_sigma, P)[s_probe]
    jitter = base * rng.lognormal(np.log(0.03), 0.8, S)
    diurnal = rng.lognormal(np.log(0.08), 0.9, S)
    fail_p = rng.beta(*FAIL_BETA, S) * FAIL_SCALE
    fail_p = np.where(~s_builtin & (rng.random(S) < FIREWALLED[0]), FIREWALLED[1], fail_p)
    fail_p = np.where(s_six & v6_broken[s_probe], 1.0, fail_p)

    # Rows per stream, then each stream's contiguous run of its schedule.
    w = uptime[s_probe] * (240.0 / s_interval)  # busyness already sets the stream count
    n_s = rng.multinomial(N, w / w.sum())
    step = np.minimum(s_interval, np.maximum(1, span // np.maximum(n_s, 1)))
    begin = (rng.random(S) * (span - n_s * step + 1)).astype(np.int64)
    sid = np.repeat(np.arange(S), n_s)
    k = np.arange(N) - np.repeat(np.cumsum(n_s) - n_s, n_s)
    t = begin[sid] + k * step[sid] + (rng.random(N) * np.minimum(step[sid], 20)).astype(np.int64)
    t = np.minimum(t, span - 1)

    rtt = _row_rtts(rng, t, p_lon[s_probe[sid]], base[sid], diurnal[sid], jitter[sid], fail_p[sid])
    src, dst, ipv = _malformed(rng, s_src[sid], s_dst[sid],
                               np.where(s_six[sid], 6, 4).astype(np.int8), len(pool) - 1)

    order = np.argsort(t * S + sid, kind="stable")  # by time; ties by stream, so deterministic
    return {"time": t[order] + START, "prb_id": prb_id[s_probe[sid]][order], "src": src[order],
            "dst": dst[order], "ip_version": ipv[order], "rtt": rtt[order],
            "msm_id": s_msm[sid][order], "size": s_size[sid][order], "pool": pool,
            "fail_p": fail_p[sid][order]}  # each row's true failure rate (not written)


def _hour_name(ts: int) -> str:
    return time.strftime("%Y-%m-%dT%H.parquet", time.gmtime(ts))


def synth(cfg: SynthConfig) -> dict:
    """Write the hourly files; returns the summary (also printed on stderr)."""
    t0 = time.perf_counter()
    cols = generate(cfg)
    pool = pa.array(cols.pop("pool"), pa.string())
    del cols["fail_p"]
    out = Path(cfg.out)
    hour = (cols["time"] - START) // 3600
    cuts = np.searchsorted(hour, np.arange(cfg.days * 24 + 1))
    names = []
    with claim(out, layout="parquet", command="prep synth", runner="synth",
               overwrite=cfg.overwrite) as od, \
            tqdm(total=cfg.rows, unit=" rows", unit_scale=True, desc="synth", file=sys.stderr,
                 disable=None) as bar:
        for h in range(cfg.days * 24):
            a, b = cuts[h], cuts[h + 1]
            if a == b:
                continue
            table = pa.table({
                "event_time": pa.array(cols["time"][a:b], pa.timestamp("s", tz="UTC")),
                "prb_id": cols["prb_id"][a:b],
                "src_addr": pool.take(pa.array(cols["src"][a:b])),
                "dst_addr": pool.take(pa.array(cols["dst"][a:b])),
                "ip_version": cols["ip_version"][a:b], "rtt": cols["rtt"][a:b],
                "msm_id": cols["msm_id"][a:b], "size": cols["size"][a:b]})
            name = _hour_name(START + h * 3600)
            pq.write_table(table, od.stage / name, compression="zstd", compression_level=1)
            names.append(name)
            bar.update(b - a)
        od.publish(names)
    elapsed = time.perf_counter() - t0
    ok = cols["rtt"] != -1
    # the rows are drawn over the probes' streams (step 3): a sparse probe, or any probe
    # past --rows, may get none, so the probes said are those with rows
    probes = int(len(np.unique(cols["prb_id"])))
    summary = {"rows": cfg.rows, "probes": probes, "probes_drawn": cfg.probes,
               "files": len(names),
               "ipv6_share": float(np.mean(cols["ip_version"] == 6)),
               "failed_share": float(np.mean(~ok)),
               "rtt_p50": float(np.percentile(cols["rtt"][ok], 50)) if ok.any() else 0.0,
               "rtt_p99": float(np.percentile(cols["rtt"][ok], 99)) if ok.any() else 0.0,
               "elapsed_s": elapsed, "rows_per_s": cfg.rows / max(elapsed, 1e-9)}
    of = f"{probes:,} of {count(cfg.probes, 'probe')}" if probes < cfg.probes else count(
        probes, "probe")
    print(f"synth: {count(cfg.rows, 'row')} from {of} over "
          f"{count(cfg.days, 'day')} in {count(len(names), 'file')} -> {out} | IPv6 {summary['ipv6_share']:.1%}, failed "
          f"{summary['failed_share']:.1%}, RTT p50 {summary['rtt_p50']:.1f} ms p99 "
          f"{summary['rtt_p99']:.1f} ms | {elapsed:.1f}s, {summary['rows_per_s']:,.0f} rows/s",
          file=sys.stderr)
    return summary
