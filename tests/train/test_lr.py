"""Learning-rate schedule against the DeePMD formulas and a step-by-step reference."""

import math

import pytest

from mdtrain.errors import MDTrainError
from mdtrain.train.lr import ExpDecayLR


def brute_force(start_lr, stop_lr, decay_steps, decay_rate, nsteps):
    """Multiply by decay_rate every decay_steps steps, clamp at stop_lr."""
    out, lr = [], start_lr
    for t in range(nsteps):
        if t > 0 and t % decay_steps == 0:
            lr *= decay_rate
        out.append(max(stop_lr, lr))
    return out


def test_water_example_decay_rate():
    lr = ExpDecayLR(1e-3, 3.51e-8, 5000, 100_000)
    assert lr.decay_steps == 5000
    assert lr.decay_rate == pytest.approx(0.599, abs=5e-4)
    assert lr.decay_rate == pytest.approx((3.51e-8 / 1e-3) ** (5000 / 100_000), rel=1e-12)
    assert lr.value(0) == 1e-3
    assert lr.value(4999) == 1e-3
    assert lr.value(5000) == pytest.approx(1e-3 * lr.decay_rate, rel=1e-12)
    assert lr.value(99_999) == pytest.approx(1e-3 * lr.decay_rate**19, rel=1e-12)
    # after numb_steps the schedule reaches stop_lr and stays there
    assert lr.value(100_000) == pytest.approx(3.51e-8, rel=1e-9)
    assert lr.value(10**7) == 3.51e-8


def test_matches_step_by_step_reference():
    lr = ExpDecayLR(2e-3, 1e-5, 7, 100)
    ref = brute_force(2e-3, 1e-5, 7, lr.decay_rate, 150)
    got = [lr.value(t) for t in range(150)]
    assert got == pytest.approx(ref, rel=1e-12)
    # pure function of the step: order of calls does not matter
    assert [lr.value(t) for t in reversed(range(150))] == got[::-1]


@pytest.mark.parametrize(
    "numb_steps, expected",
    [(500, 6), (1000, 11), (1009, 11), (1010, 100), (20_000, 100)],
)
def test_decay_steps_adjusted_when_too_large(numb_steps, expected):
    lr = ExpDecayLR(1e-3, 1e-8, numb_steps, numb_steps)
    assert lr.decay_steps == expected
    assert lr.decay_rate == pytest.approx((1e-8 / 1e-3) ** (expected / numb_steps), rel=1e-12)


def test_explicit_decay_rate_wins_and_keeps_decay_steps():
    lr = ExpDecayLR(1e-3, 1e-8, 5000, 1000, decay_rate=0.5)
    assert lr.decay_steps == 5000 and lr.decay_rate == 0.5
    assert lr.value(4999) == 1e-3 and lr.value(5000) == 5e-4
    clamp = ExpDecayLR(1e-3, 3e-4, 10, 1000, decay_rate=0.5)
    assert clamp.value(20) == 3e-4  # 2.5e-4 clamped to stop_lr


def test_zero_stop_lr_uses_floor_of_1e_10():
    lr = ExpDecayLR(1e-3, 0.0, 10, 100)
    assert lr.decay_rate == pytest.approx(math.exp(math.log(1e-7) / 10), rel=1e-12)
    assert lr.value(100) == pytest.approx(1e-10, rel=1e-9)


def test_smooth_uses_continuous_exponent():
    lr = ExpDecayLR(1e-3, 1e-6, 10, 100, smooth=True)
    assert lr.value(5) == pytest.approx(1e-3 * lr.decay_rate**0.5, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(start_lr=0.0), "start_lr"),
        (dict(decay_rate=1.5), "decay_rate"),
        (dict(decay_steps=0), "decay_steps"),
        (dict(numb_steps=0), "numb_steps"),
    ],
)
def test_invalid_values(kwargs, word):
    args = dict(start_lr=1e-3, stop_lr=1e-8, decay_steps=10, numb_steps=100) | kwargs
    with pytest.raises(MDTrainError, match=word):
        ExpDecayLR(**args)


# ---------------------------------------------------------------------------------------------
# DeePMD-kit 3.2's schedules with warm-up, against formulas written out here


def warmup_reference(step, warmup, start, factor):
    """Linear warm-up: interpolation between factor*start at step 0 and start at `warmup`."""
    return factor * start * (1 - step / warmup) + start * (step / warmup)


def schedule(**lr):
    from mdtrain.train.lr import make_schedule

    numb_steps = lr.pop("numb_steps")
    return make_schedule({"start_lr": 1e-3, **lr}, numb_steps)


STEPS = [0, 1, 7, 19, 20, 21, 57, 100, 150, 198, 199, 250]


def test_exp_with_warmup_and_smooth():
    start, stop, numb, warm = 1e-3, 1e-6, 200, 20
    for smooth in (False, True):
        lr = schedule(type="exp", stop_lr=stop, decay_steps=30, warmup_steps=warm,
                      warmup_start_factor=0.1, smooth=smooth, numb_steps=numb)  # fmt: skip
        rate = (stop / start) ** (30 / (numb - warm))
        for step in STEPS:
            got = lr.value(step)
            if step < warm:
                want = warmup_reference(step, warm, start, 0.1)
            else:
                t = step - warm
                want = max(stop, start * rate ** (t / 30 if smooth else math.floor(t / 30)))
            assert got == pytest.approx(want, rel=1e-12), (smooth, step)
    # smooth decay reaches stop_lr at the last step + 1
    assert lr.value(numb) == pytest.approx(stop, rel=1e-9)


def test_cosine_with_warmup_ratio():
    start, stop, numb = 1e-3, 1e-5, 200
    lr = schedule(type="cosine", stop_lr=stop, warmup_ratio=0.1, numb_steps=numb)
    assert lr.warmup_steps == 20
    for step in STEPS:
        if step < 20:
            want = warmup_reference(step, 20, start, 0.0)
        elif step - 20 >= numb - 20:
            want = stop
        else:
            theta = math.pi * (step - 20) / (numb - 20)
            want = stop + (start - stop) * (1 + math.cos(theta)) / 2
        assert lr.value(step) == pytest.approx(want, rel=1e-12, abs=1e-20), step
    assert lr.value(110) == pytest.approx((start + stop) / 2, rel=1e-12)  # half-way


@pytest.mark.parametrize("rule", ["inverse_linear", "cosine", "linear"])
def test_wsd(rule):
    start, stop, numb, warm = 1e-3, 1e-5, 200, 20
    lr = schedule(type="wsd", stop_lr=stop, warmup_steps=warm, decay_phase_ratio=0.25,
                  decay_type=rule, numb_steps=numb)  # fmt: skip
    decay_len = 50  # int(0.25 * 200), within the 180 post-warm-up steps
    stable_end = numb - decay_len  # absolute step where the decay starts
    for step in [*STEPS, stable_end - 1, stable_end, stable_end + 1, 175, 199]:
        if step < warm:
            want = warmup_reference(step, warm, start, 0.0)
        elif step < stable_end:
            want = start
        elif step >= numb:
            want = stop
        else:
            tau = (step - stable_end) / decay_len
            want = {
                "inverse_linear": 1 / ((1 - tau) / start + tau / stop),
                "cosine": stop + (start - stop) * (1 + math.cos(math.pi * tau)) / 2,
                "linear": (1 - tau) * start + tau * stop,
            }[rule]
        assert lr.value(step) == pytest.approx(want, rel=1e-12), step


def test_stop_lr_from_ratio_and_default():
    assert schedule(type="cosine", stop_lr_ratio=0.01, numb_steps=10).stop_lr == pytest.approx(1e-5)
    assert schedule(type="cosine", numb_steps=10).stop_lr == 5e-8


def test_warmup_not_shorter_than_the_run_is_refused():
    with pytest.raises(MDTrainError, match="warmup_steps"):
        schedule(type="exp", warmup_steps=10, numb_steps=10, stop_lr=1e-5)
    assert schedule(type="exp", warmup_ratio=0.95, numb_steps=10, stop_lr=1e-5).warmup_steps == 9
