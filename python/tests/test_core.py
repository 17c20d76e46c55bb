"""The extension stepcore._core itself: import without torch, zero-copy arrays from numpy
and torch, errors that name the argument (and change nothing), results against the
independent expectations (numpy/torch arithmetic written here), and the GIL released."""

import hashlib
import platform
import subprocess
import sys
import threading

import numpy as np
import pytest

import stepcore


def test_import_does_not_import_torch():
    code = "import sys, stepcore; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_version_and_isas():
    assert stepcore.__version__.count(".") == 2
    isas = stepcore.supported_isas()
    baseline = {"x86_64": "sse2", "aarch64": "neon"}[platform.machine()]  # always present
    assert baseline in isas
    for isa in isas:
        assert stepcore.Engine(isa=isa, threads=1).isa == isa


def f32_round(x):
    return np.float32(x)


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 1025])
def test_accumulate_and_scale_match_numpy(n):
    rng = np.random.default_rng(n)
    e = stepcore.Engine(threads=2)
    acc = rng.standard_normal(n).astype(np.float32)
    src = rng.standard_normal(n).astype(np.float32)
    want = (acc + src).astype(np.float32)  # one f32 addition per element
    e.accumulate([acc], [src])
    assert acc.tobytes() == want.tobytes()
    e.accumulate([acc], [src], copy=True)
    assert acc.tobytes() == src.tobytes()
    g = rng.standard_normal(n).astype(np.float32)
    want = (g * np.float32(0.37)).astype(np.float32)
    e.scale_([g], 0.37)
    assert g.tobytes() == want.tobytes()


def test_norm_partial_words_combine_exactly():
    rng = np.random.default_rng(7)
    e = stepcore.Engine(threads=2)
    parts = [(rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30)).astype(np.float32)
             for n in (5, 1000, 0, 77)]
    whole = np.concatenate(parts).astype(np.float32)
    combined = np.zeros(stepcore.PARTIAL_WORDS, dtype=np.int64)
    for p in parts:  # what a SUM / MAX all-reduce over ranks does
        w = e.norm_partial([p], exact=True)
        k = stepcore.PARTIAL_MAX_ABS_WORD
        combined[k] = max(combined[k], w[k])
        mask = np.arange(stepcore.PARTIAL_WORDS) != k
        combined[mask] += w[mask]
    norm, finite, max_abs, needs_exact = stepcore.finalize(combined)
    assert finite and not needs_exact
    # The exact norm with Python integers: every f32 square is a multiple of 2^-298.
    from fractions import Fraction
    s = sum(Fraction(float(x)) ** 2 for x in whole)
    assert norm == float(np.float32(exact_sqrt_rounded_f32(s)))
    assert max_abs == float(np.max(np.abs(whole)))


def exact_sqrt_rounded_f32(s):
    """The f32 nearest sqrt(s) for a non-negative Fraction s (ties cannot occur)."""
    import math
    if s == 0:
        return 0.0
    # sqrt(s) = sqrt(num/den); scale to an integer with plenty of bits, then round.
    num, den = s.numerator, s.denominator
    shift = 200
    r = math.isqrt((num << (2 * shift)) // den)  # floor(sqrt(s) * 2^shift)
    approx = r / (1 << shift)
    lo = np.float32(approx)
    # Pick the f32 neighbour whose square is closest to s (monotone: compare midpoints).
    cands = [np.nextafter(lo, np.float32(0)), lo, np.nextafter(lo, np.float32(np.inf))]
    from fractions import Fraction
    best = min(cands, key=lambda c: abs(Fraction(float(c)) - Fraction(r, 1 << shift)))
    return float(best)


def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def adamw_args(n=100):
    rng = np.random.default_rng(1)
    p = rng.standard_normal(n).astype(np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    s = np.zeros((), np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    return p, m, v, s, g


HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@pytest.mark.parametrize(
    "spoil, exc, name",
    [
        (lambda a, h: a.__setitem__(0, a[0][::2]), ValueError, "params[0]"),
        (lambda a, h: a.__setitem__(4, a[4].astype(np.float64)), TypeError, "grads[0]"),
        (lambda a, h: a.__setitem__(3, np.zeros(2, np.float32)), ValueError, "steps[0]"),
        (lambda a, h: a.__setitem__(1, a[1][:50]), ValueError, "exp_avgs[0]"),
        (lambda a, h: h.__setitem__("lr", float("nan")), ValueError, "'lr'"),
        (lambda a, h: h.__setitem__("beta1", 1.0), ValueError, "'beta1'"),
        (lambda a, h: h.__setitem__("eps", -1.0), ValueError, "'eps'"),
        (lambda a, h: a.__setitem__(1, a[0]), ValueError, "exp_avgs[0]"),  # overlaps params[0]
    ],
)
def test_bad_input_names_the_argument_and_changes_nothing(spoil, exc, name):
    e = stepcore.Engine(threads=1)
    args = list(adamw_args())
    hyper = dict(HYPER)
    spoil(args, hyper)
    p, m, v, s, g = args
    before = digest(p, m, v, s, g)
    with pytest.raises(exc) as info:
        e.step("adamw", [p], [[m], [v]], [s], [g], hyper=hyper)
    assert name in str(info.value)
    assert digest(p, m, v, s, g) == before


def test_unknown_formula_and_isa_are_refused():
    e = stepcore.Engine(threads=1)
    p, m, v, s, g = adamw_args()
    with pytest.raises(ValueError, match="formula"):
        e.step("adamw", [p], [[m], [v]], [s], [g], hyper=dict(HYPER, formula="fused"))
    with pytest.raises(ValueError, match="isa"):
        stepcore.Engine(isa="avx1024")


def test_a_corrupt_partial_is_refused():
    w = np.zeros(stepcore.PARTIAL_WORDS, np.int64)
    w[3] = -1
    with pytest.raises(ValueError, match="negative"):
        stepcore.finalize(w)
    with pytest.raises(ValueError, match="words"):
        stepcore.finalize(np.zeros(5, np.int64))


def test_torch_tensors_bf16_and_wrong_device():
    torch = pytest.importorskip("torch")
    e = stepcore.Engine(threads=2)
    g = torch.randn(257, dtype=torch.bfloat16)
    acc = torch.zeros(257)
    e.accumulate([acc], [g], copy=True)
    assert torch.equal(acc, g.float())  # the exact widening, read without a copy
    meta = torch.zeros(4, device="meta")  # no memory at all: not an array DLPack can describe
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        e.scale_([torch.zeros(4), meta], 2.0)


def test_two_threads_step_at_once_and_match_sequential_runs():
    """The GIL is released around kernels: two threads step disjoint sets concurrently."""
    n = 1 << 20
    sets = [adamw_args(n) for _ in range(2)]
    copies = [[a.copy() for a in s] for s in sets]
    e = stepcore.Engine(threads=1)
    for p, m, v, s, g in copies:  # sequential expectation
        for _ in range(3):
            e.step("adamw", [p], [[m], [v]], [s], [g], hyper=HYPER)
    inside = [0, 0]

    def run(k):
        p, m, v, s, g = sets[k]
        for _ in range(3):
            e.step("adamw", [p], [[m], [v]], [s], [g], hyper=HYPER)
        inside[k] = 1

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert inside == [1, 1]
    for got, want in zip(sets, copies):
        assert digest(*got) == digest(*want)
