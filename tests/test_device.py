"""No silent CPU: a visible NVIDIA GPU with a CPU-only jax is an error naming the install;
`make setup` picks the CUDA extra from nvidia-smi (faked on PATH)."""

import os
import subprocess
from pathlib import Path

import pytest
from helpers import REPO

from prep.base.errors import InputError
from train.fit import device


def fake_nvidia_smi(d: Path, cuda: str = "13.0") -> Path:
    exe = d / "nvidia-smi"
    exe.write_text("#!/bin/sh\n"
                   'if [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)"; '
                   f'else echo "| NVIDIA-SMI 580.65   Driver Version: 580.65   CUDA Version: {cuda} |"; fi\n')
    exe.chmod(0o755)
    return d


def test_gpu_visible_but_jax_on_cpu_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path)}:{os.environ['PATH']}")
    assert device.nvidia_gpus() == ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)"]
    with pytest.raises(InputError) as e:
        device.check_backend("auto")
    msg = str(e.value)
    assert "nvidia-smi lists 1 GPU(s) (GPU 0: NVIDIA H100 80GB HBM3) but jax has no GPU" in msg
    assert "pip install -e '.[cuda13]'" in msg and "--device cpu" in msg
    assert device.check_backend("cpu") == "cpu"
    with pytest.raises(InputError, match="--device gpu, but jax runs on cpu"):
        device.check_backend("gpu")


def test_no_gpu_no_complaint(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    assert device.nvidia_gpus() == []
    assert device.check_backend("auto") == "cpu"


@pytest.mark.parametrize("cuda, extra", [("13.0", "cuda13"), ("12.4", "cuda12")])
def test_make_setup_picks_the_cuda_extra(tmp_path, cuda, extra):
    env = dict(os.environ, PATH=f"{fake_nvidia_smi(tmp_path, cuda)}:{os.environ['PATH']}")
    out = subprocess.run(["make", "-n", "setup", f"VENV={tmp_path / 'venv'}"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert f"pip install -q --no-cache-dir -e '.[dev,plots,{extra}]'" in out, out


def test_make_setup_without_a_gpu_and_overrides(tmp_path):
    env = dict(os.environ, PATH=f"{tmp_path}:/usr/bin:/bin")
    run = lambda *a: subprocess.run(["make", "-n", "setup", f"VENV={tmp_path / 'venv'}", *a],
                                    cwd=REPO, env=env, capture_output=True, text=True,
                                    check=True).stdout
    assert "pip install -q --no-cache-dir -e '.[dev,plots]'" in run()
    assert "pip install -q --no-cache-dir -e '.[dev,plots,cuda12]'" in run("CUDA=12")
    fake_nvidia_smi(tmp_path)
    assert "pip install -q --no-cache-dir -e '.[dev,plots]'" in run("CUDA=none")


def test_train_with_a_visible_gpu_and_cpu_jax_is_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from train.cli import main

    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path)}:{os.environ['PATH']}")
    r = CliRunner().invoke(main, ["--data", str(tmp_path / "none"), "--steps", "1"])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: nvidia-smi lists 1 GPU(s)"), lines
    assert "pip install -e '.[cuda13]'" in lines[0]


def test_make_device_kit_fetches_the_venvs_versions_for_python_312(tmp_path):
    """`make device-kit`: each wheel a lent machine's image lacks, at this venv's version,
    for its Python 3.12 (the commands, not run: `make -n`)."""
    out = subprocess.run(["make", "-n", "device-kit", f"VENV={tmp_path / 'venv'}"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    loop = out[out.index("for p in"):]
    assert "for p in grain array-record msgspec portpicker orbax-checkpoint; do" in loop
    assert ("--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 "
            "--platform manylinux_2_27_x86_64") in loop
    assert f"{tmp_path / 'venv'}/bin/prep synth --out data/raw-1m --rows 1000000" in out
    assert "--out shards-1m" in out


def test_the_lease_script_parses_and_names_its_kit():
    script = REPO / "bench" / "lease.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert 'carry [".whl", "shards-1m"]' in text and "make device-kit" in text
