import json

import numpy as np
import pytest
from click.testing import CliRunner

from prep.cli import main
from prep.schema import manifest
from prep.tools import analyze

CFG = analyze.AnalyzeConfig(crop=1024, batch_size=2, grain_bins=(2,), grain_sample=100,
                            max_segments=2)
LENGTHS = np.array([600, 500, 400, 300, 1024, 10])
PROBE = np.array([0, 0, 1, 1, 2, 3])  # histories of 1100, 700, 1024 and 10 tokens


def _row(name, rows, kept, truncated, segs, note=""):
    return {"name": name, "rows": rows, "steps": -(-rows // 2),
            "padding_fraction": 1 - kept / (rows * 1024), "truncated_tokens": truncated,
            "segments_p50": segs and segs[0], "segments_p99": segs and segs[1],
            "segments_max": segs and segs[2], "useful_tokens_per_row": kept / rows, "note": note}


def test_every_number_of_a_small_table():
    r = analyze.analyze(analyze.Contexts(LENGTHS, PROBE), CFG)
    assert (r["contexts"], r["tokens"], r["lower_bound_rows"]) == (6, 2834, 3)
    counts = r["length_histogram"]["counts"]
    # bars 1-64 ... 961-1024: the 1024-token context is in the last one, which ends on the
    # row length (issue 36, item 1: a "1024-1087" bar crossed the row-length line)
    assert len(counts) == 16 and {i: c for i, c in enumerate(counts) if c} == \
        {0: 1, 4: 1, 6: 1, 7: 1, 9: 1, 15: 1}
    assert r["length_histogram"]["edges"][-2:] == [961, 1025]
    whole = "whole contexts (lengths only: no splitting)"
    assert r["strategies"] == [
        _row("pad-to-crop", 6, 2834, 0, (1, 1, 1)),
        # one window per probe: the 1100-token history loses 76 tokens
        _row("probe-window", 4, 2758, 76, (1, 1, 1)),
        # 2 bins: [600 400] [500 300] are emitted when 1024 fits neither, then [1024] [10]
        _row("grain-first-fit-2", 4, 2834, 0, (2, 2, 2)),
        _row("grain-best-fit-2", 4, 2834, 0, (2, 2, 2)),
        # best-fit decreasing: [1024] [600 400 10] [500 300]
        _row("packer", 3, 2834, 0, (2, 3, 3), whole),
        _row("packer-cap2", 4, 2834, 0, (2, 2, 2), whole),
        _row("lower-bound", 3, 2834, 0, None),
    ]


def test_grain_sample_is_scaled_and_said():
    cfg = analyze.AnalyzeConfig(grain_bins=(2,), grain_sample=3)
    g = [s for s in analyze.strategies(analyze.Contexts(np.full(12, 600)), cfg)
         if s["name"] == "grain-first-fit-2"][0]
    assert (g["rows"], g["note"]) == (
        12, "estimated: 3 of 12 contexts, rows scaled (>= lower bound)")


def test_a_scaled_sample_never_beats_the_lower_bound():
    assert analyze.scaled_rows(129, 2_000, 2_000, 131) == 131  # the 129-against-131 case
    assert analyze.scaled_rows(3, 3, 12, 8) == 12
    assert analyze.scaled_rows(0, 0, 0, 0) == 0


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
    from prep.ingest.synth import SynthConfig, synth
    from prep.shards.bucket import ShardsConfig
    from prep.shards.local_runner import run_shards

    d = tmp_path_factory.mktemp("analyze")
    synth(SynthConfig(out=d / "raw", rows=20_000, probes=40, days=1, seed=3))
    run_shards([str(d / "raw")], str(d / "shards"), ShardsConfig(n_buckets=2), workers=1,
               progress=False)
    return d


def test_shards_figures_equal_the_manifest(shards_dir):
    m = manifest.load_manifest(shards_dir / "shards")
    r = analyze.analyze(analyze.load(str(shards_dir / "shards"), CFG), CFG)
    p = [s for s in r["strategies"] if s["name"] == "packer"][0]
    assert p["rows"] == sum(s["rows"] for s in m["splits"].values())
    assert p["padding_fraction"] == pytest.approx(m["padding_fraction"], abs=1e-12)
    assert p["segments_max"] == max(int(k) for k in m["segments_per_row"])
    # issue 36, item 1: the strategies run on the contexts before packing (planned again
    # from the manifest's inputs), not on the pieces our packer cut to fit; the lower
    # bound is the manifest's
    assert (r["unit"], r["contexts"]) == ("contexts", m["counts"]["contexts"])
    assert r["lower_bound_rows"] == m["lower_bound_rows"]
    assert r["strategies"][-1]["rows"] == m["lower_bound_rows"]
    assert [s["name"] for s in r["strategies"]] == [
        "pad-to-crop", "probe-window", "grain-first-fit-2", "grain-best-fit-2", "packer",
        "lower-bound"]
    assert r["source"] == (f"shards {shards_dir / 'shards'} ({p['rows']:,} rows): its contexts "
                           f"planned again from its {len(m['inputs'])} input files")


def test_shards_without_their_inputs_say_what_they_compare(shards_dir, tmp_path):
    # issue 36, item 1: without the inputs, the stored pieces are not passed off as contexts
    # nor handed to other packers
    import shutil

    from prep.shards.bucket import ShardsConfig
    from prep.shards.local_runner import run_shards

    shutil.copytree(shards_dir / "raw", tmp_path / "raw")
    run_shards([str(tmp_path / "raw")], str(tmp_path / "shards"), ShardsConfig(n_buckets=2),
               workers=1, progress=False)
    shutil.rmtree(tmp_path / "raw")
    m = manifest.load_manifest(tmp_path / "shards")
    r = analyze.analyze(analyze.load(str(tmp_path / "shards"), CFG), CFG)
    assert (r["unit"], r["contexts"]) == ("stored segments", m["counts"]["segments"])
    assert [(s["name"], s["rows"]) for s in r["strategies"]] == [
        ("packer", sum(m["counts"]["rows"].values())), ("lower-bound", m["lower_bound_rows"])]
    first = m["inputs"][0]["name"]
    assert r["note"] == (
        f"these are the packer's pieces of {m['counts']['contexts']:,} contexts, cut to fill "
        f"rows; other packers are compared on the contexts, which need the inputs ({first} is "
        "not there): prep analyze-padding INPUT --crop 1024")
    text = analyze.format_report(r).splitlines()
    assert text[0].endswith(f"{m['counts']['segments']:,} stored segments, "
                            f"{m['counts']['tokens']:,} tokens, crop 1024, lower bound "
                            f"{m['lower_bound_rows']:,} rows")
    assert text[1] == f"note: {r['note']}"


def test_a_crop_other_than_the_shards_row_length_is_one_line(shards_dir):
    # issue 36, item 2: --crop 256 on rows of 1024 printed "-299.63 %" padding, exit 0
    d = shards_dir / "shards"
    res = CliRunner().invoke(main, ["analyze-padding", str(d), "--crop", "256"])
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines()[-1] == (
        f"error: --crop 256: the shards in {d} hold rows of 1024 tokens; analyze them with "
        "--crop 1024, or analyze their parquet input with --crop 256")
    assert analyze.crop_for(str(d), None) == 1024  # without --crop: the shards' own


def test_config_line_and_row_len_help_read_as_flags():
    # issue 36, item 13: the config echoed as a Python repr; --row-len without a word
    assert analyze.config_line(analyze.AnalyzeConfig()) == (
        "crop=1024, batch_size=64, grain_bins=4,32,256, grain_sample=2000, max_segments=16, "
        "seed=0")
    h = " ".join(CliRunner().invoke(main, ["shards", "--help"]).output.split())
    assert ("--row-len INTEGER RANGE Tokens per row, the model's sequence length; no context "
            "is longer. 256 for the CPU recipe") in h
    assert "prep shards data/raw --out shards-256 --split time+probe --row-len 256" in h


def test_parquet_matches_shards_packing(shards_dir):
    # the parquet path plans the same contexts prep shards did (bucketing aside)
    m = manifest.load_manifest(shards_dir / "shards")
    ctx = analyze.load(str(shards_dir / "raw"), CFG)
    assert len(ctx.lengths) == m["counts"]["contexts"]
    lb = [s for s in analyze.strategies(ctx, CFG) if s["name"] == "lower-bound"][0]
    assert lb["rows"] == -(-int(ctx.lengths.sum()) // 1024)


def test_cli_json_and_plot(shards_dir, tmp_path):
    png = tmp_path / "pad.png"
    res = CliRunner().invoke(main, ["analyze-padding", str(shards_dir / "raw"), "--json",
                                    "--grain-sample", "50", "--plot", str(png)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    names = [s["name"] for s in out["strategies"]]
    assert names[0] == "pad-to-crop" and names[-1] == "lower-bound" and "packer-cap16" in names
    assert all({"rows", "padding_fraction", "truncated_tokens"} <= s.keys()
               for s in out["strategies"])
    assert out["lower_bound_rows"] == out["strategies"][-1]["rows"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_without_a_suffix_says_the_png_it_wrote(shards_dir, tmp_path):
    # matplotlib adds .png to a name without a suffix; the line said "wrote .../pad"
    res = CliRunner().invoke(main, ["analyze-padding", str(shards_dir / "raw"),
                                    "--grain-sample", "50", "--plot", str(tmp_path / "pad")])
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines()[-1] == f"wrote {tmp_path / 'pad.png'}"
    assert [p.name for p in tmp_path.iterdir()] == ["pad.png"]  # and no check file left


def test_a_plot_it_cannot_write_is_refused_before_the_analysis(shards_dir, tmp_path,
                                                               monkeypatch):
    # a path in a read-only folder was a traceback after the whole analysis
    from helpers import read_only

    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(analyze, "analyze", lambda *a: pytest.fail("analyzed"))
    with read_only(monkeypatch, ro):
        res = CliRunner().invoke(main, ["analyze-padding", str(shards_dir / "raw"),
                                        "--plot", str(ro / "pad.png")])
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines()[-1] == (
        f"Error: Invalid value for '--plot': {ro / 'pad.png'}: read-only file system; name a "
        "file in a folder you can write")
    assert list(ro.iterdir()) == []


def test_grain_sample_0_means_all_contexts(shards_dir):
    # the README (and --help) say 0 = all; the CLI used to refuse it
    res = CliRunner().invoke(main, ["analyze-padding", str(shards_dir / "shards"), "--json",
                                    "--grain-sample", "0"])
    assert res.exit_code == 0, res.output
    grain = [s for s in json.loads(res.stdout)["strategies"] if s["name"].startswith("grain-")]
    assert len(grain) == 6 and {s["note"] for s in grain} == {""}  # not "estimated"


EXPECTED = ("`prep analyze-padding` reads parquet measurements (make some with `prep synth`, or "
            "from RIPE Atlas results with `prep import-atlas`) or a shards folder (made by "
            "`prep shards`)")


def test_an_input_with_nothing_to_analyze_says_what_it_reads(tmp_path):
    # a user trial: an empty folder was taken for an unfinished shards folder ("no
    # manifest.json ... run `prep shards INPUT --out DIR`"), a folder of other files said
    # only "holds files of an unknown format", and parquet without measurements printed a
    # table of zeros, exit 0
    from helpers import T0, exit_2_one_line, write_parquet

    def analyze_padding(path):
        return CliRunner().invoke(main, ["analyze-padding", str(path)])

    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not measurements\n")
    for folder in ("empty", "notes"):
        assert exit_2_one_line(analyze_padding(tmp_path / folder)) == (
            f"error: {tmp_path / folder}: no .parquet files found, nor a shards folder's "
            f"manifest.json; {EXPECTED}")
    assert exit_2_one_line(analyze_padding(tmp_path / "notes" / "a.txt")) == (
        f"error: {tmp_path / 'notes' / 'a.txt'} is of an unknown format; {EXPECTED}")

    rec = {"event_time": T0, "prb_id": 1, "src_addr": "192.0.2.1", "dst_addr": "192.0.2.9",
           "ip_version": 4, "rtt": 1.0}
    write_parquet(tmp_path / "bad" / "a.parquet", [
        rec | {"rtt": float("nan")}, rec | {"dst_addr": ""}, rec | {"dst_addr": ""}])
    assert exit_2_one_line(analyze_padding(tmp_path / "bad")) == (
        f"error: {tmp_path / 'bad'}: no measurements to analyze (1 parquet file of 3 rows, all "
        f"rejected (empty_dst_addr 2, bad_rtt 1)); {EXPECTED}")
    write_parquet(tmp_path / "none" / "a.parquet", [rec])
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "none" / "a.parquet")
    pq.write_table(t.slice(0, 0), tmp_path / "none" / "a.parquet")
    assert exit_2_one_line(analyze_padding(tmp_path / "none")) == (
        f"error: {tmp_path / 'none'}: no measurements to analyze (1 parquet file of 0 rows); "
        f"{EXPECTED}")


def test_shards_files_without_a_manifest_are_an_unfinished_dataset(shards_dir, tmp_path):
    # what is_shards now asks sniff: shard files make a shards folder, a manifest or not
    import shutil

    from helpers import exit_2_one_line

    shutil.copytree(shards_dir / "shards", tmp_path / "s")
    (tmp_path / "s" / "manifest.json").unlink()
    r = CliRunner().invoke(main, ["analyze-padding", str(tmp_path / "s"), "--crop", "1024"])
    assert exit_2_one_line(r) == (
        f"error: {tmp_path / 's'}: no manifest.json, so not a finished dataset; run `prep "
        f"shards INPUT --out {tmp_path / 's'}` to build it")


def test_parquet_is_planned_as_prep_shards_plans_it_per_split_and_bucket(tmp_path):
    # a user trial: the contexts were planned in one pass over both splits, where prep
    # shards plans each split (and bucket) alone, and a context's cuts depend on the other
    # measurements there (the planner's supply of free bodies): 132,685 tokens against
    # prep shards' 132,504 on this input
    from prep.ingest.synth import SynthConfig, synth
    from prep.shards.bucket import ShardsConfig
    from prep.shards.local_runner import run_shards

    synth(SynthConfig(out=tmp_path / "raw", rows=5_000, probes=40, days=1, seed=0))
    run_shards([str(tmp_path / "raw")], str(tmp_path / "shards"), ShardsConfig(n_buckets=0),
               workers=1, progress=False)  # the command's defaults
    m = manifest.load_manifest(tmp_path / "shards")
    assert m["counts"]["rows"]["test"] > 0  # both splits hold rows
    r = analyze.analyze(analyze.load(str(tmp_path / "raw"), CFG), CFG)
    assert (r["contexts"], r["tokens"], r["note"]) == (
        m["counts"]["contexts"], m["counts"]["tokens"], "")
    assert r["tokens"] == 132_504


def test_a_lone_probe_held_out_for_test_is_said(tmp_path):
    # a user trial: on one probe whose history is one context, prep shards refuses (its only
    # probe is in test: no training rows) while the report planned a row as if it wrote one
    from helpers import T0, write_parquet

    from prep.shards.bucket import is_test_probe

    prb = next(p for p in range(1, 100) if is_test_probe(np.array([p]), 0.1)[0])
    write_parquet(tmp_path / "raw" / "a.parquet", [
        {"event_time": T0 + 60 * i, "prb_id": prb, "src_addr": "192.0.2.1",
         "dst_addr": "193.0.14.129", "ip_version": 4, "rtt": 10.0 + i} for i in range(3)])
    shards = CliRunner().invoke(main, ["shards", str(tmp_path / "raw"), "--out",
                                       str(tmp_path / "s"), "--quiet", "--workers", "1"])
    assert shards.exit_code == 2
    assert "no training rows written: all 1 rows went to the test split" in shards.stderr
    r = CliRunner().invoke(main, ["analyze-padding", str(tmp_path / "raw"), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    # three IPv4 pings of 14 tokens, the context drawn without timestamps (seed 0)
    assert (out["contexts"], out["tokens"], out["lower_bound_rows"]) == (1, 42, 1)
    assert out["note"] == (
        "`prep shards` with its defaults would write nothing of this: its 1 probe is held out "
        "for test (--split probe, --test-fraction 0.1), leaving no training rows; lower "
        "--test-fraction or give more probes")
    text = analyze.format_report(out).splitlines()
    assert text[:2] == [f"{tmp_path / 'raw'} (parquet, 3 measurements): 1 context, 42 tokens, "
                        "crop 1024, lower bound 1 row", f"note: {out['note']}"]
