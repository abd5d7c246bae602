"""`make bench-gpu`: training throughput of the base (~95M) config on the GPU(s) here.

Runs the real trainer (train.fit.loop.train: Grain reader, packed cuDNN attention, bf16
compute, data-parallel over all local GPUs) for a few hundred steps and reports, over
the steps after warm-up: real (non-padding) tokens/s, MFU, the share of step time spent
waiting for data, step time, and the device's peak memory (the allocator's high-water
mark over the whole process). Writes ``bench/results/gpu-<device>.json``.

``--trace-steps N`` records a jax.profiler trace of the last N steps and adds the ops
that took the most device time per step (``top_ops``; on a CPU, the XLA ops on the host)
to the JSON; those steps are left out of the timings.

Targets on one H100: >= 45 % MFU, >= 700k real tokens/s, < 1 % data
wait. Without a GPU it runs the tiny config on the CPU so the script itself stays tested,
says so, and writes ``bench/results/gpu-cpu-tiny.json`` (not a GPU result).

    python -m bench.gpu                       # synthetic 1024-token rows
    python -m bench.gpu --data shards/ --steps 300 --batch-size 32
    python -m bench.gpu --data shards/ --steps 40 --batch-size 64 --trace-steps 5
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench.run import RESULTS, machine
from prep.schema import vocab
from prep.tools import synthetic_shards as synthetic
from train.fit.config import GPU_ROWS, TrainConfig
from train.fit.loop import train


def _synthetic_shards(d: Path, rows: int) -> Path:
    """1024-token rows like the built-in data's: ~8 contexts a row, 0.2 % padding."""
    tokens, segs = synthetic.counting_rows(rows, 1024, seed=0, max_segments=16, pad=2)
    rng = np.random.default_rng(0)
    tokens = np.where(segs > 0, rng.integers(0, vocab.VOCAB_SIZE, tokens.shape), 0)
    split = rows // 16
    synthetic.write_shards(d, {"train": (tokens[split:].astype(np.uint16), segs[split:]),
                               "test": (tokens[:split].astype(np.uint16), segs[:split])},
                           rows_per_shard=rows // 4)
    return d


def device_name() -> str:
    """The first device's kind as a file-name part: 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")


# lines of a device plane that repeat its kernels' time under other names (derived views)
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework Name Scope", "Framework Ops",
                  "Source code", "XLA TraceMe")

# host ops whose events enclose other ops' events (the layer scan's loop)
_NESTING = ("while", "call", "conditional")


def top_ops(trace_dir: Path, steps: int, n: int = 25, module: str = "train_step") -> dict:
    """The ``n`` XLA ops of the jitted ``module`` that took the most time in a jax.profiler
    trace under ``trace_dir`` of ``steps`` steps: device kernels where the trace has a device
    (a GPU: the kernels on its streams), else the host's XLA ops (a CPU). Each: the HLO op,
    one kernel name it ran as, milliseconds per step and share of the traced op time.
    ``module_matched`` is False where no event named the module (then every op counts)."""
    from jax.profiler import ProfileData

    found = sorted(trace_dir.glob("plugins/profile/*/*.xplane.pb"))
    if not found:
        raise FileNotFoundError(f"no jax.profiler trace (*.xplane.pb) under {trace_dir}")
    data = ProfileData.from_file(str(found[-1]))
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    where = "device" if planes else "host"
    events = []  # (op, kernel, ns, module)
    for plane in planes or [p for p in data.planes if p.name.startswith("/host:")]:
        lines = [ln for ln in plane.lines if ln.name not in _DERIVED_LINES]
        if planes and any(ln.name.startswith("Stream") for ln in lines):
            lines = [ln for ln in lines if ln.name.startswith("Stream")]
        for line in lines:
            for e in line.events:
                stats = dict(e.stats)
                if where == "host" and ("hlo_op" not in stats
                                        or str(stats["hlo_op"]).startswith(_NESTING)):
                    continue  # Python, the runtime's bookkeeping; a loop (its ops count)
                op = str(stats.get("hlo_op") or e.name)
                if op.startswith("command_buffer"):  # a CUDA graph of many ops: its kernel
                    op = e.name
                events.append((op, e.name, e.duration_ns, str(stats.get("hlo_module", ""))))
    matched = any(module in m for *_, m in events)
    ns, kernel = collections.Counter(), {}
    for op, name, t, m in events:
        if matched and module not in m:
            continue
        ns[op] += t
        kernel.setdefault(op, name)
    total = sum(ns.values()) or 1
    kinds = collections.Counter()
    for op, t in ns.items():
        kinds[kernel_kind(kernel[op])] += t
    return {"where": where, "steps": steps, "module_matched": matched,
            "ms_per_step": sum(ns.values()) / 1e6 / steps,
            "kinds": {k: {"ms_per_step": t / 1e6 / steps, "share": t / total}
                      for k, t in kinds.most_common()},
            "ops": [{"op": op, "kernel": kernel[op][:120], "ms_per_step": t / 1e6 / steps,
                     "share": t / total} for op, t in ns.most_common(n)]}


def _keep_trace(trace_dir: Path, path: Path) -> None:
    """The newest *.xplane.pb under ``trace_dir``, gzipped, at ``path``."""
    import gzip
    import shutil

    found = sorted(trace_dir.glob("plugins/profile/*/*.xplane.pb"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(found[-1], "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)


def kernel_kind(name: str) -> str:
    """What a GPU kernel does, from its name: matmul (cuBLAS/nvjet, XLA's gemm fusions),
    attention (cuDNN), copy (memcpy/memset), elementwise (XLA's other fusions), other."""
    n = name.lower()
    if "nvjet" in n or "gemm" in n or "cublas" in n or "cutlass" in n:
        return "matmul"
    if "cudnn" in n or "sdpa" in n:
        return "attention"
    if n.startswith(("memcpy", "memset")):
        return "copy"
    if n.startswith(("loop_", "input_", "wrapped_", "fusion", "triton")):
        return "elementwise"
    return "other"


class _TraceFrom:
    """on_step for train.fit.loop.train: starts a jax.profiler trace once step ``first`` is
    done; ``stop`` ends it (after train returns, which waits for the device). A profiler
    that cannot start (no CUPTI, say) costs the run its top ops, not its timings."""

    def __init__(self, first: int, trace_dir: Path):
        self.first, self.dir, self.on, self.error = first, trace_dir, False, None

    def __call__(self, step: int) -> None:
        if step == self.first:
            try:
                jax.profiler.start_trace(str(self.dir))
                self.on = True
            except Exception as e:  # reported in the JSON as the reason for no top ops
                self.error = f"start_trace: {type(e).__name__}: {e}"[:300]
                print(f"[bench-gpu] no profile: {self.error}", file=sys.stderr)

    def stop(self) -> None:
        if self.on:
            jax.profiler.stop_trace()
            self.on = False


def model_overrides(pairs: list[str]) -> dict:
    """``--model-set KEY=VALUE`` pairs as ModelConfig fields of their declared types."""
    from train.model.arch import ModelConfig

    fields = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"--model-set {pair!r}: KEY=VALUE with KEY one of {', '.join(fields)}")
        kind = fields[key] if isinstance(fields[key], str) else fields[key].__name__
        if kind == "bool":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--model-set {pair!r}: {key} is true or false")
            out[key] = value.lower() in ("true", "1")
        else:
            try:
                out[key] = {"int": int, "float": float}.get(kind, str)(value)
            except ValueError:
                raise ValueError(f"--model-set {pair!r}: {key} is a {kind}") from None
    return out


def memory_gib() -> tuple[float | None, float | None]:
    """(peak allocation so far, the allocator's limit), GiB, of the first device, where the
    backend reports them (a GPU; the limit is XLA_PYTHON_CLIENT_MEM_FRACTION of the card,
    75 % unless set)."""
    stats = jax.devices()[0].memory_stats() or {}
    gib = lambda k: stats[k] / 2**30 if k in stats else None
    return gib("peak_bytes_in_use"), gib("bytes_limit")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", help="a shards folder (default: synthetic rows)")
    p.add_argument("--steps", type=int, help="default: 300 on a GPU, 30 on a CPU")
    p.add_argument("--batch-size", type=int, help="rows per step (default: train's, 48 per GPU)")
    p.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn", "dense"])
    p.add_argument("--out", help="the JSON's path [bench/results/gpu-<device>.json]")
    p.add_argument("--log-every", type=int, help="steps a timing window (default: 25 on a GPU, 5 on a CPU)")
    p.add_argument("--trace-steps", type=int, default=0,
                   help="profile the last N steps; their top ops go into the JSON [0: none]")
    p.add_argument("--trace-out", help="with --trace-steps: also keep the trace, gzipped, at this "
                                       "path (for TensorBoard or xprof) [not kept]")
    p.add_argument("--segment-table", type=int, default=None, metavar="M",
                   help="size cuDNN's segment tables for M segments a row (at least what "
                        "the data holds; the synthetic rows hold 16, the built-in shards 68) "
                        "[the data's]")
    p.add_argument("--segment-tables", default="batch", choices=["batch", "data"],
                   help="cuDNN's segment tables sized per batch or once for the dataset "
                        "(train --segment-tables) [batch]")
    p.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the model's ModelConfig for this run, e.g. "
                        "scan_layers=false (repeatable) [none]")
    args = p.parse_args(argv)

    from prep.schema.errors import InputError
    from train.fit.device import check_backend

    try:
        gpu = check_backend("auto") == "gpu"  # a GPU jax cannot use is an error, not the CPU
    except InputError as e:
        print(f"[bench-gpu] error: {e}", file=sys.stderr)
        return 2
    n = jax.device_count()
    try:
        overrides = model_overrides(args.model_set)
    except ValueError as e:
        p.error(str(e))
    if gpu:
        settings = dict(model="base", steps=args.steps or 300, batch_size=args.batch_size or GPU_ROWS * n,
                        compute_dtype="bfloat16", log_every=args.log_every or 25, lr=6e-4,
                        warmup=50)
        name = device_name()
    else:
        print("[bench-gpu] no GPU here: running the tiny config on the CPU to exercise the "
              "script; these are not GPU numbers", file=sys.stderr)
        settings = dict(model="tiny", steps=args.steps or 30, batch_size=args.batch_size or 8,
                        compute_dtype="float32", log_every=args.log_every or 5, lr=3e-3, warmup=5)
        name = "cpu-tiny"
    from train.model import arch

    if args.segment_table:  # the trainer sizes the tables from the manifest: a larger one
        from train.fit import reader

        data_max = reader.max_segments
        reader.max_segments = lambda manifest: max(args.segment_table, data_max(manifest))
    if overrides:  # this process's preset, changed before the trainer reads it
        arch.MODELS[settings["model"]] = dataclasses.replace(arch.MODELS[settings["model"]],
                                                             **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(_synthetic_shards(Path(tmp) / "shards", 4096 if gpu else 256))
        cfg = TrainConfig(data=data, run_dir=str(Path(tmp) / "run"), eval_every=0,
                          ckpt_every=0, attention=args.attention,
                          segment_tables=args.segment_tables, **settings)
        trace = args.trace_steps
        if trace and cfg.steps - trace < 2 * cfg.log_every:  # the first window warms up
            print(f"[bench-gpu] error: --trace-steps {trace} leaves no timed window of "
                  f"{cfg.log_every} steps after the first in {cfg.steps} steps", file=sys.stderr)
            return 2
        tracer = _TraceFrom(cfg.steps - trace, Path(tmp) / "trace") if trace else None
        t0 = time.perf_counter()
        try:
            summary = train(cfg, on_step=tracer)
        finally:
            if tracer:
                tracer.stop()
        wall = time.perf_counter() - t0
        recs = [json.loads(x) for x in (Path(tmp) / "run/metrics.jsonl").read_text().splitlines()]
        ops = None
        if tracer:
            try:
                ops = {"error": tracer.error} if tracer.error else top_ops(tracer.dir, trace)
                if args.trace_out and not tracer.error:
                    _keep_trace(tracer.dir, Path(args.trace_out))
            except Exception as e:  # an unreadable trace: say so, keep the timings
                ops = {"error": f"reading the trace: {type(e).__name__}: {e}"[:300]}
    # the first window still warms up; windows that reach into the traced steps are slowed
    # by the profiler
    peak, limit = memory_gib()
    timed = [r for r in recs
             if "step_ms" in r and not (trace and r["step"] > cfg.steps - trace)][1:]
    mean = lambda k: float(np.mean([r[k] for r in timed])) if timed and timed[0].get(k) is not None else None
    metrics = {
        "gpu.real_tokens_per_s": mean("tokens_per_s"), "gpu.mfu": mean("mfu"),
        "gpu.data_wait": mean("data_wait"), "gpu.step_ms": mean("step_ms"),
        "gpu.final_loss": summary["loss"], "gpu.params": summary["params"],
        "gpu.devices": n, "gpu.batch_size": cfg.batch_size, "gpu.wall_s": wall,
        "gpu.peak_gib": peak, "gpu.memory_limit_gib": limit,
        # steps run at each segment-table size (per batch), None with one size
        "gpu.segment_tables": summary.get("segment_tables"),
    }
    out = {"machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "gpu": gpu,
           "config": {**settings, "attention": summary["attention"], "data": args.data or "synthetic",
                      "model_set": overrides, "segment_table": args.segment_table,
                      "segment_tables": args.segment_tables},
           "metrics": metrics, **({"top_ops": ops} if ops else {})}
    path = Path(args.out) if args.out else RESULTS / f"gpu-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    for k, v in metrics.items():
        print(f"{k:<24} {'-' if v is None else v if isinstance(v, dict) else f'{v:,.4g}'}")
    if ops and "error" in ops:
        print(f"top ops: none ({ops['error']})")
    for kind, v in (ops or {}).get("kinds", {}).items():
        print(f"  {v['ms_per_step']:8.2f} ms/step {100 * v['share']:5.1f} %  {kind}")
    for op in (ops or {}).get("ops", [])[:10]:
        print(f"  {op['ms_per_step']:8.2f} ms/step {100 * op['share']:5.1f} %  {op['op']}  "
              f"({op['kernel'][:60]})")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
