"""Training: exact resume (through a real SIGINT), data parallelism, a falling loss, the CLI."""

import json
import os
import signal
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import (
    FAST_COMPILE,
    assert_same_end,
    python_c,
    records,
    small,
    write_dataset,
)

from prep.base.errors import InputError
from prep.schema import vocab
from train.cli import main
from train.fit import step as step_lib
from train.fit.config import TrainConfig
from train.fit.loop import train
from train.model import model
from train.model.arch import MODELS, STORE_K


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("train") / "shards", rows_per_shard=64)


def test_resume_after_ctrl_c_equals_straight_run(shards, tmp_path):
    train(small(shards, tmp_path / "straight"))

    def ctrl_c_at_10(step):
        if step == 10:
            os.kill(os.getpid(), signal.SIGINT)  # the real handler: finish step, save, return

    first = train(small(shards, tmp_path / "split"), on_step=ctrl_c_at_10)
    assert first["interrupted"] and first["step"] == 10
    second = train(small(shards, tmp_path / "split", resume=True))
    assert second["step"] == 20 and not second["interrupted"]

    a, b = records(tmp_path / "straight"), records(tmp_path / "split")
    assert [r["step"] for r in b] == list(range(1, 21))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit-identical
    assert_same_end(tmp_path / "straight", tmp_path / "split")


def test_existing_run_needs_resume(shards, tmp_path):
    stop = lambda step: step == 2 and os.kill(os.getpid(), signal.SIGINT)
    assert train(small(shards, tmp_path / "r"), on_step=stop)["step"] == 2
    with pytest.raises(InputError, match="already holds a run at step 2; pass --resume"):
        train(small(shards, tmp_path / "r"))


DP_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from train.fit.config import TrainConfig
    from train.fit.loop import train
    from train.fit.checkpoint import Checkpointer
    assert jax.device_count() == 4, jax.devices()
    out = {}
    for n in (4, 1):
        run = f"{sys.argv[2]}/dp{n}"
        cfg = TrainConfig(data=sys.argv[1], run_dir=run, steps=4, batch_size=8, lr=3e-3,
                          warmup=2, log_every=1, eval_every=0, ckpt_every=0)
        s = train(cfg, devices=jax.devices()[:n])
        ck = Checkpointer(run + "/checkpoints")
        state, _ = ck.restore(4)
        ck.close()
        losses = [json.loads(l).get("loss") for l in open(run + "/metrics.jsonl")]
        out[n] = {"losses": losses,
                  "params": [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(state["params"])]}
    print("RESULT" + json.dumps(out))
""")


# XLA's CPU compiler without its costly LLVM passes (as tests/test_train_multihost.py): a
# third of the compile time; both runs compared use the same flags, and the sharding under
# test is decided before those passes


def test_data_parallel_on_4_cpu_devices_matches_1(shards, tmp_path):
    proc = python_c(DP_SCRIPT, shards, tmp_path, timeout=300,
                    XLA_FLAGS="--xla_force_host_platform_device_count=4 " + FAST_COMPILE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    four, one = out["4"], out["1"]
    losses4 = [x for x in four["losses"] if x is not None]
    losses1 = [x for x in one["losses"] if x is not None]
    assert len(losses4) == 4
    np.testing.assert_allclose(losses4, losses1, rtol=1e-5)
    for a, b in zip(four["params"], one["params"]):
        # Adam divides by sqrt(v): float reordering in the all-reduce shows up as ~1e-6
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_loss_falls_on_builtin_data(builtin_shards, tmp_path):
    cfg = TrainConfig(data=str(builtin_shards), run_dir=str(tmp_path / "run"), steps=50,
                      batch_size=8, lr=3e-3, warmup=10, log_every=10, eval_every=50,
                      eval_rows=32, ckpt_every=0)
    s = train(cfg)
    recs = [r for r in records(tmp_path / "run") if "loss" in r]
    first, last = recs[0]["loss"], recs[-1]["loss"]
    assert first > 4.5  # about ln(267) = 5.59 at initialization
    assert last < first - 1.0, (first, last)
    # the test split's probes were never trained on; uniform guessing is ln(267) = 5.59
    assert s["eval_loss"] < np.log(267) - 0.8, s["eval_loss"]
    ev = [r for r in records(tmp_path / "run") if "eval_loss" in r]
    assert [(r["step"], r["eval_rows"]) for r in ev] == [(50, 32)]
    assert sorted(ev[0]["eval_loss_by_role"]) == sorted(
        ["marker", "src", "dst", "timestamp", "result", "rtt"])
    assert all(r["tokens_per_s"] > 0 and 0 <= r["data_wait"] <= 1 for r in recs[1:])


# the same settings as small(), so the CLI runs reuse the step compiled by the tests above
CLI_FLAGS = ["--model", "tiny", "--steps", "20", "--batch-size", "4", "--lr", "3e-3",
             "--warmup", "3"]


def test_cli_trains_and_writes_metrics(shards, tmp_path):
    run = tmp_path / "cli-run"
    args = ["--data", str(shards), "--run-dir", str(run), "--log-every", "10",
            "--eval-every", "20", "--eval-rows", "4", "--ckpt-every", "10", *CLI_FLAGS]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "done: step 20 | loss" in result.stdout
    recs = records(run)
    assert [r["step"] for r in recs if "loss" in r] == [10, 20]
    assert [r["step"] for r in recs if "eval_loss" in r] == [20]
    assert {"step", "loss", "tokens_per_s", "mfu", "data_wait", "step_ms", "lr"} <= set(recs[0])
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [10, 20]
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "pass --resume" in again.stderr


def test_cli_resumes_an_interrupted_run(shards, tmp_path):
    run = tmp_path / "r"
    stop = lambda step: step == 7 and os.kill(os.getpid(), signal.SIGINT)
    assert train(small(shards, run, log_every=10), on_step=stop)["interrupted"]
    result = CliRunner().invoke(main, ["--data", str(shards), "--run-dir", str(run), "--resume",
                                       "--log-every", "10", "--eval-every", "0", *CLI_FLAGS])
    assert result.exit_code == 0, result.output
    assert "resumed" in result.stderr and "done: step 20" in result.stdout
    assert [r["step"] for r in records(run)] == [7, 10, 20]


def test_flops_per_step_counts_real_tokens_and_their_context():
    cfg = MODELS["base"]
    # one row: segments of 3 and 2 tokens, 1 padding -> contexts 1+2+3 + 1+2 = 9
    stats = model.flop_counts(np.array([[1, 1, 1, 2, 2, 0]], np.uint8))
    assert int(stats["tokens"]) == 5 and float(stats["attn_ctx"]) == 9.0
    n = model.matmul_params(cfg)
    assert n == 98_501_120  # every parameter but the embedding table
    assert model.train_flops(cfg, 5, 9) == 6 * n * 5 + 12 * 20 * 640 * 9
    assert step_lib.peak_flops(type("D", (), {"device_kind": "NVIDIA H100 80GB HBM3"})) == 989e12
    assert step_lib.peak_flops(type("D", (), {"device_kind": "cpu"})) is None


def test_eval_step_sums_by_every_token_role():
    # prep.schema.vocab.ROLES (seven, then one per value field) and one spare; 8 with no value field
    assert step_lib.N_ROLES == len(vocab.ROLES) + 1
    assert vocab.VALUE_FIELDS or step_lib.N_ROLES == 8


def test_cli_model_choices_are_the_registry():
    fit = main.commands["fit"]
    opt = next(p for p in fit.params if p.name == "model")
    assert list(opt.type.choices) == list(MODELS) == ["tiny", "small", "base"]
    bad = CliRunner().invoke(main, ["--model", "huge", "--data", "x"])
    assert bad.exit_code == 2 and "'tiny', 'small', 'base'" in bad.stderr


def test_small_preset_and_its_cpu_recipe():
    """The CPU recipe (docs/learning.md): tiny's shape plus the grammar embedding (7 role
    rows and 17 byte-index rows of 64), the destination match's gain per layer (2), the
    byte waves' mixes (14 waves by 64, in and out), the destination memory (8,192 rows of
    64) and prior (8,192 rows of 16, their map to the 267 tokens, the gate's 64), the
    context copy's gate (64, a bias, two widths), the destination and placed stores' gates
    and the pair store's two (its reverse and its own pair; the same), trained on anonymous
    sources, and its own CPU defaults under --model small."""
    from train.fit.config import defaults_for
    from train.model.arch import n_params

    small, tiny = MODELS["small"], MODELS["tiny"]
    assert small.grammar_embed and not tiny.grammar_embed
    assert (small.match_dst, small.byte_features, tiny.match_dst, tiny.byte_features) == (
        4.0, 7, 0.0, 0)
    assert (small.dst_memory, small.dst_prior_scale, small.anonymize_src) == (8192, 30.0, True)
    assert (small.context_copy, small.copy_aux, tiny.context_copy) == (0.3, 1.0, 0.0)
    assert (small.dst_store, small.pair_store, tiny.dst_store, STORE_K) == (32768, 65536, 0, 64)
    # the pair store read at the own pair too, learning on a fold of contexts (8.20)
    assert (small.pair_forward, small.pair_min, small.pair_reverse, tiny.pair_forward) == (
        8, 4, True, 0)
    assert (small.placed_store, tiny.placed_store) == (0.25, 0.0)
    assert (small.krig_store, tiny.krig_store) == (0, 0)  # no gain on the built-in data (8.13)
    # the gates learn on a fold of the probes that the stores leave out too (8.17)
    assert (small.gate_fold, small.store_without_fold, tiny.store_without_fold) == (8, True, False)
    # the stores (32,768 rows of 64 quantiles, a count and a check) are data, not counted;
    # each read of a store (plain, placed, reverse pair, own pair) has a gate (64), a bias
    # and two widths; the read of the own pair's failures a gate and a bias (8.21); the
    # P(failed) the context baselines' rule on the row's counts: six constants, and a gate
    # and a bias for the residual's logit on it (8.31; 8.29's update's gate and bias gone)
    assert n_params(small) == (n_params(tiny) + (7 + 17) * 64 + 2 + 2 * 14 * 64
                               + 8192 * 64 + 8192 * 16 + 16 * 267 + 64
                               + 64 + 1 + 2 + 4 * (64 + 1 + 2) + 64 + 1
                               + 6 + 64 + 1) == 796_297
    assert (small.context_fail, tiny.context_fail) == (4.0, 0.0)
    assert small.context_fail_anchor and not tiny.context_fail_anchor
    # the pair store's quantiles over each pair's latest 8 replies, and its failures (8.21)
    assert (small.pair_recent, small.pair_fail, tiny.pair_recent, tiny.pair_fail) == (
        8, True, 0, False)
    d = defaults_for("cpu", model="small")
    assert (d["model"], d["steps"], d["batch_size"], d["lr"], d["warmup"], d["loss_weights"]) == (
        "small", 2400, 8, 3e-3, 100, "rtt=10,result=10")
    assert defaults_for("cpu")["model"] == "tiny" and defaults_for("gpu")["model"] == "base"


def test_small_preset_names_what_it_sets_and_warns_off_its_recipe(shards, tmp_path):
    # issue 36, item 12: --model small also set eval_rows, log_every, eval and checkpoint
    # intervals, named nowhere; on rows other than 256, or --steps inside its warm-up, it
    # said nothing
    r = CliRunner().invoke(main, ["--data", str(shards), "--model", "small", "--steps", "2",
                                  "--batch-size", "2", "--eval-every", "0", "--run-dir",
                                  str(tmp_path / "run"), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    err = r.stderr.splitlines()
    at = next(i for i, line in enumerate(err) if line.startswith("config: "))
    assert err[at + 1:at + 4] == [
        "preset small set: --lr 0.003, --warmup 100, --loss-weights rtt=10,result=10, "
        "--dtype float32, --log-every 100, --eval-rows 64, --ckpt-every 400 (flags given "
        "override them)",
        f"warning: --model small: its CPU recipe (docs/learning.md) reads rows of 256 tokens; "
        f"{shards} holds rows of 64, each 0.25x the tokens and more attention per row; build "
        "the recipe's data with `prep shards ... --row-len 256`",
        "warning: --steps 2 ends inside the 100-step warm-up: the learning rate never reaches "
        "--lr 0.003 (pass --warmup below --steps, or more --steps)"]


def test_small_preset_is_spelled_out_in_help():
    h = " ".join(CliRunner().invoke(main, ["fit", "--help"]).output.split())
    assert ("small: the CPU recipe (rows of 256, docs/learning.md); on a CPU it also sets "
            "--steps 2400, --batch-size 8, --lr 0.003, --warmup 100, --loss-weights "
            "rtt=10,result=10, --dtype float32, --log-every 100, --eval-every 400, --eval-rows "
            "64, --ckpt-every 400, each overridden by its flag") in h


def _read_scalars(path) -> dict:
    """tag -> [(step, value)] from an event file (TFRecord framing: length, its crc, an
    Event proto, its crc), read without TensorBoard."""
    import struct

    from tensorboardX.proto import event_pb2

    data, out, at = path.read_bytes(), {}, 0
    while at < len(data):
        (n,) = struct.unpack("<Q", data[at:at + 8])
        ev = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
        at += 12 + n + 4
        for v in ev.summary.value:
            out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_a_run_writes_tensorboard_events_beside_metrics_jsonl(shards, tmp_path):
    # issue 36, item 16: loss, tokens/s, MFU and eval loss live in TensorBoard
    pytest.importorskip("tensorboardX", reason="the tensorboard extra is not installed")
    run = tmp_path / "run"
    train(small(shards, run, steps=4, log_every=2, eval_every=2, eval_rows=4))
    events = list(run.glob("events.out.tfevents.*"))
    assert len(events) == 1
    got = _read_scalars(events[0])
    jsonl = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for tag, key in (("train/loss", "loss"), ("eval/loss", "eval_loss"),
                     ("train/tokens_per_s", "tokens_per_s"), ("train/lr", "lr")):
        want = [(r["step"], r[key]) for r in jsonl if key in r]
        assert [s for s, _ in got[tag]] == [s for s, _ in want] == [2, 4], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in want], rel=1e-6)
    assert {"train/grad_norm", "train/step_ms", "train/data_wait"} <= set(got)


def test_without_tensorboardx_a_run_says_so_once_and_goes_on(shards, tmp_path, monkeypatch,
                                                            capsys):
    import builtins

    real = builtins.__import__

    def no_tbx(name, *a, **k):
        if name.startswith("tensorboardX"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tbx)
    from train.fit.board import MISSING

    train(small(shards, tmp_path / "run", steps=2))
    assert capsys.readouterr().err.splitlines().count(MISSING) == 1
    assert not list((tmp_path / "run").glob("events.out.tfevents.*"))
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
