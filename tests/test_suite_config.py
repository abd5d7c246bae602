"""The suite's own settings (pyproject.toml's [tool.pytest.ini_options]) as `make test`
runs them."""

import subprocess
import sys

from helpers import REPO


def test_a_skipped_test_is_listed_with_its_reason(tmp_path):
    # issue 36, item 15: `make test` said "6 skipped" and never why (the GPU tests)
    (tmp_path / "test_one.py").write_text(
        "import pytest\n\n\n@pytest.mark.skip(reason='needs an NVIDIA GPU')\n"
        "def test_gpu():\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"),
                        "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
                        str(tmp_path / "test_one.py")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SKIPPED [1] test_one.py:4: needs an NVIDIA GPU" in r.stdout.splitlines(), r.stdout
