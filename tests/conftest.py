from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the real RIPE Atlas sample (38 files, 7,725 results; its README says where each came
# from), shipped with the tests so that a clone without ../shared runs the same suite
ATLAS = REPO / "tests" / "fixtures" / "ripe-atlas"


@pytest.fixture(scope="session")
def atlas_dir() -> Path:
    assert ATLAS.is_dir(), f"{ATLAS} is missing from the checkout"
    return ATLAS


@pytest.fixture(scope="session")
def builtin_shards(tmp_path_factory):
    """The real pipeline (prep synth -> prep shards) on a small built-in-style dataset."""
    from prep.ingest.synth import SynthConfig, synth
    from prep.shards.bucket import ShardsConfig
    from prep.shards.local_runner import run_shards

    d = tmp_path_factory.mktemp("builtin")
    synth(SynthConfig(out=d / "raw", rows=12_000, probes=100, days=1, seed=0))
    run_shards([str(d / "raw")], str(d / "shards"), ShardsConfig(seed=0, row_len=128),
               workers=1, progress=False)
    return d / "shards"
