from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
ATLAS = SHARED / "data" / "ripe-atlas"


@pytest.fixture(scope="session")
def atlas_dir() -> Path:
    if not ATLAS.is_dir():
        pytest.skip(f"{ATLAS} is missing (the RIPE Atlas sample lives in ../shared)")
    return ATLAS
