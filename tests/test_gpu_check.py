"""bench/gpu_check.py: the learning run cut to a lent machine's time budget."""

from bench import gpu_check as gc


def test_learning_steps_fit_the_budget():
    # 600 s left, 30 s compiling, 4 points of 30 s: 450 s of steps at 100k tokens/s, 90 %
    # of it, in steps of 48 rows of 1024 tokens: 0.9 * 450 * 100_000 / 49_152 = 823.9
    assert gc.learning_steps(100_000, 600, 48, 1024, 4) == 823
    # the H200's 225,405 tokens/s and the 378 s it had left (make gpu-check, 64 rows)
    assert gc.learning_steps(225_405, 378, 64, 1024, 4) == int(0.9 * 228 * 225_405 / 65_536)


def test_learning_steps_bounds():
    assert gc.learning_steps(None, 600, 48, 1024, 4) == gc.LEARNING_STEPS  # no rate: full run
    assert gc.learning_steps(1e9, 10_000, 48, 1024, 4) == gc.LEARNING_STEPS  # never more
    assert gc.learning_steps(100_000, 100, 48, 1024, 4) == 100  # too little time: 100 steps
