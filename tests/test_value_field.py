"""What a new token field costs: tests/fixtures/size_field.patch adds the packet size (2 bytes)
as a value field. It touches two production modules (docs/ARCHITECTURE.md says which and
why no others); here it is applied to a copy of the code and run end to end: synthetic
data and the real RIPE Atlas sample through `prep shards` and `prep verify`, the kernel
against its oracle, the three token readers against each other and the input.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from prep.schema import vocab as V

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PATCH = FIXTURES / "size_field.patch"
# its copy of the code compiles its own kernels, into a folder of its own
pytestmark = pytest.mark.no_kernel_warmup


def patched_files() -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", PATCH.read_text(), re.M)


def test_a_token_field_touches_two_production_modules():
    files = patched_files()
    assert files == ["prep/schema/measurements.py", "prep/schema/vocab.py"]
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    assert all(f"`{f}`" in doc for f in files)
    assert V.VALUE_FIELDS == ()  # the product's vocabulary has none


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("size-field")
    for pkg in ("prep", "train"):
        shutil.copytree(REPO / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(["git", "apply", str(PATCH)], cwd=copy, capture_output=True, text=True)
    assert done.returncode == 0, f"the patch no longer applies; refresh it:\n{done.stderr}"
    return copy


@pytest.mark.slow
def test_the_packet_size_end_to_end(patched, tmp_path, atlas_dir):
    env = {**os.environ, "PYTHONPATH": str(patched), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    done = subprocess.run([sys.executable, str(FIXTURES / "value_field_run.py"), str(tmp_path),
                           str(atlas_dir)], cwd=patched, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["vocab_size"] == 268 and out["names"] == ["SIZE_START"]
    synth = out["synth"]
    assert synth["same_as_input"] and synth["errors"] == 0
    assert sum(synth["sizes"].values()) * 2 == synth["size_role_tokens"]  # two bytes each
    assert set(synth["sizes"]) == {"32", "48", "64", "1000"}
    assert synth["first_segment_sizes"] == synth["first_segment_sizes_rowdecode"] != []
    assert out["kernel_contexts"] > 0
    assert out["missing_block_codes"] == [0, 10]  # sound; INCOMPLETE
    atlas = out["atlas"]
    assert atlas["same_as_input"] and atlas["errors"] == 0
    assert set(atlas["inspect_sizes"]) <= {12, 20, 32, 48, 64} and atlas["inspect_sizes"]
    # the sample's sizes, each measurement's own
    assert atlas["sizes"] == atlas["parquet_sizes"] == {"12": 12, "20": 2494, "32": 1459,
                                                        "48": 3092, "64": 535}
