"""Which accelerator `train` and the GPU benchmark run on, and no silent fall back to a CPU.

``nvidia_gpus()`` lists the GPUs ``nvidia-smi -L`` sees (the driver's view, independent
of jax). ``check_backend(device)`` compares that with jax's backend: a machine with an
NVIDIA GPU whose jax has no GPU backend (a CPU-only jax, a CUDA plugin that does not
load) would otherwise train the tiny model on the CPU without a word, so that is an
InputError naming the install command, unless the user asked for ``--device cpu``.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from prep.base.errors import InputError

INSTALL = "pip install -e '.[cuda13]' (or '.[cuda12]' for a CUDA 12 driver; `make setup` picks one)"


def nvidia_gpus() -> list[str]:
    """``nvidia-smi -L`` lines naming a GPU; empty without nvidia-smi or a working driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in out.stdout.splitlines() if line.startswith("GPU ")]


def use_cpu() -> None:
    """Make jax use the CPU even where a GPU backend exists (before jax picks a backend)."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_platforms", "cpu")


def check_backend(device: str = "auto") -> str:
    """The platform jax will run on ("gpu", "cpu", ...); InputError when an NVIDIA GPU is
    visible but jax cannot use it and ``device`` is not "cpu"."""
    if device == "cpu":
        use_cpu()
    import jax

    try:
        platform = jax.devices()[0].platform
    except RuntimeError as e:  # a CUDA plugin that is installed but fails to start
        raise InputError(f"jax could not start its backend ({str(e).splitlines()[0]}); "
                         f"check the CUDA install ({INSTALL}) or pass --device cpu") from None
    if device == "gpu" and platform != "gpu":
        raise InputError(f"--device gpu, but jax runs on {platform}; {INSTALL}")
    if device == "auto" and platform != "gpu":
        gpus = nvidia_gpus()
        if gpus:
            raise InputError(f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0].split(' (')[0]}) but "
                             f"jax has no GPU backend, so this would run on the CPU; {INSTALL}; "
                             "or pass --device cpu to run on the CPU on purpose")
    return platform
