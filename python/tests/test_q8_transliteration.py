"""8-bit AdamW state against an independent transliteration of docs/numerics.md: the native
formula (7.1) between section 8f's dequantization and requantization (the nearest code in
exact arithmetic, ties away from zero), written here from the text in numpy f32 operations
and Python fractions. stepcore.reference_step and Engine.step on every ISA must give its
bits after every step of ten: params, codes and block maxima."""

from fractions import Fraction

import numpy as np
import pytest

import stepcore

F32 = np.float32
BLOCK = stepcore.Q8_BLOCK_SIZE
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1,
         "formula": "native"}
# beta1 = 0: the new exp_avg is the gradient itself, so a gradient at the midpoint of two
# codes' values (times the block maximum, 1) is an exact tie for the requantization.
TIES = dict(HYPER, beta1=0.0, beta2=0.999, weight_decay=0.0)


def f32(x):
    return np.float32(x)


def scalars(t, h):
    """Section 7.1's per-step scalars for step t (the counter after its increment)."""
    lr, b1, b2 = f32(h["lr"]), f32(h["beta1"]), f32(h["beta2"])
    eps, wd = f32(h["eps"]), f32(h["weight_decay"])
    decay = f32(1.0 - float(lr) * float(wd))
    omb1, omb2 = f32(1.0) - b1, f32(1.0) - b2
    bc1 = 1.0 - float(b1) ** float(t)
    bc2 = 1.0 - float(b2) ** float(t)
    step_size = f32(float(lr) / bc1)
    bc2_sqrt = f32(np.sqrt(bc2))
    return dict(b1=b1, b2=b2, eps=eps, decay=decay, omb1=omb1, omb2=omb2,
                step_size=step_size, bc2_sqrt=bc2_sqrt)


def native_update(p, g, m, v, k):
    """Section 7.1's element lines, each operation rounded to f32 (numpy f32 arrays)."""
    with np.errstate(all="ignore"):
        p = p * k["decay"]
        m = (m * k["b1"]) + (g * k["omb1"])
        v = (v * k["b2"]) + ((g * g) * k["omb2"])
        d = (np.sqrt(v) / k["bc2_sqrt"]) + k["eps"]
        p = p - ((k["step_size"] * m) / d)
    return p, m, v


def nearest_code(y, values, zero_code):
    """Section 8f's N(y): the code whose value is nearest to y in exact arithmetic, a tie to
    the larger magnitude, a NaN to the zero code."""
    if y != y:
        return zero_code
    hi = int(np.searchsorted(values, y, side="left"))  # first value >= y
    if hi < len(values) and values[hi] == y:
        return hi
    if hi == 0:
        return 0
    if hi == len(values):
        return len(values) - 1
    lo = hi - 1
    dy_lo = Fraction(float(y)) - Fraction(float(values[lo]))
    dy_hi = Fraction(float(values[hi])) - Fraction(float(y))
    if dy_lo < dy_hi:
        return lo
    if dy_hi < dy_lo:
        return hi
    return hi if y > 0 else lo  # a tie: away from zero


def requantize(x, values, zero_code):
    """Section 8f's requantization of one block's new values: (codes, stored maximum)."""
    if np.isnan(x).any():
        a = np.array([0x7FC00000], np.uint32).view(np.float32)[0]
    else:
        a = f32(np.abs(x).max()) if len(x) else f32(0)
    with np.errstate(all="ignore"):
        y = x / a
    return np.array([nearest_code(v, values, zero_code) for v in y], np.uint8), a


class Transliteration:
    """One tensor's param and 8-bit moments, stepped as the text says."""

    def __init__(self, p, hyper):
        n = len(p)
        self.hyper = hyper
        self.p = p.copy()
        self.codes = [np.full(n, 127, np.uint8), np.zeros(n, np.uint8)]  # the zero codes
        self.absmax = [np.zeros((n + BLOCK - 1) // BLOCK, np.float32) for _ in range(2)]
        self.maps = [np.array(stepcore.q8_map(False), np.float32),
                     np.array(stepcore.q8_map(True), np.float32)]
        self.zero = [127, 0]
        self.t = 0

    def step(self, g):
        self.t += 1
        k = scalars(self.t, self.hyper)
        for b in range(len(self.absmax[0])):
            s = slice(b * BLOCK, min((b + 1) * BLOCK, len(self.p)))
            with np.errstate(all="ignore"):
                m = self.maps[0][self.codes[0][s]] * self.absmax[0][b]
                v = self.maps[1][self.codes[1][s]] * self.absmax[1][b]
            self.p[s], m, v = native_update(self.p[s], g[s], m, v, k)
            for j, x in enumerate((m, v)):
                self.codes[j][s], self.absmax[j][b] = requantize(x, self.maps[j], self.zero[j])


def gradient(rng, n, step):
    """Gradients with all-zero blocks, single non-zeros, exact zeros, magnitudes from 2^-60
    to 2^20, and at step 6 one NaN in the second block."""
    g = np.ldexp(rng.standard_normal(n).astype(np.float32),
                 rng.integers(-60, 20, n)).astype(np.float32)
    g[::5] = 0.0
    for b in range(0, (n + BLOCK - 1) // BLOCK, 3):
        g[b * BLOCK:(b + 1) * BLOCK] = 0.0
        if b % 2:
            g[b * BLOCK + 7 if b * BLOCK + 7 < n else b * BLOCK] = F32(3.5)
    if step == 6 and n > BLOCK + 3:
        g[BLOCK + 3] = np.nan
    return g


def same(a, b, what):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype == np.float32:  # an f32 NaN result is "a NaN" (numerics.md 2)
        nan = np.isnan(a) & np.isnan(b)
        a, b = np.where(nan, 0, a), np.where(nan, 0, b)
    assert a.tobytes() == b.tobytes(), what


def ties(n, step):
    """Block 0: 1, then the midpoints of consecutive signed values that f32 holds exactly,
    both signs (exact ties once divided by the block maximum 1); the rest as gradient()."""
    g = gradient(np.random.default_rng(step), n, step)
    values = np.array(stepcore.q8_map(False), np.float64)
    mids = [(a + b) / 2 for a, b in zip(values[:-1], values[1:])
            if float(f32((a + b) / 2)) == (a + b) / 2]
    block = np.array([1.0] + mids + [-x for x in mids], np.float32)[:min(n, BLOCK)]
    g[:len(block)] = block[::1 if step % 2 else -1][:len(block)]
    g[0] = F32(1.0)
    return g


@pytest.mark.parametrize("hyper,grads", [(HYPER, "random"), (TIES, "ties")])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 1500])
def test_reference_and_engine_equal_the_transliteration(n, hyper, grads):
    rng = np.random.default_rng(n)
    start = (rng.standard_normal(n) * 0.5).astype(np.float32)
    want = Transliteration(start, hyper)
    runs = [("reference", None)] + [(isa, stepcore.Engine(isa=isa, threads=3))
                                    for isa in stepcore.supported_isas()]
    states = {name: ([start.copy()],
                     [[(np.full(n, 127, np.uint8), np.zeros_like(want.absmax[0]))],
                      [(np.zeros(n, np.uint8), np.zeros_like(want.absmax[1]))]],
                     [np.zeros((), np.float32)]) for name, _ in runs}
    for step in range(1, 11):
        g = gradient(rng, n, step) if grads == "random" else ties(n, step)
        want.step(g)
        for name, engine in runs:
            params, slots, counters = states[name]
            if engine is None:
                stepcore.reference_step("adamw", params, slots, counters, [g], hyper=hyper)
            else:
                engine.step("adamw", params, slots, counters, [g], hyper=hyper)
            what = f"{name}, n {n}, step {step}"
            same(params[0], want.p, what + ": param")
            for k in range(2):
                same(slots[k][0][0], want.codes[k], what + f": codes of slot {k}")
                same(slots[k][0][1], want.absmax[k], what + f": maxima of slot {k}")
