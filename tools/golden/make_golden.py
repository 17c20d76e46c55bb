#!/usr/bin/env python3
# Purpose: write the PyTorch golden files in tests/data/ that tests/test_golden.cpp replays
# bit for bit: every optimizer file from one table (OPTIMIZERS: torch's class, the
# hyper-parameters by stepcore's names, the state slots) through one writer; clip_grad_norm_
# through its own; and the analysers that test the formula hypotheses behind docs/numerics.md.
"""Generate stepcore's golden files from PyTorch (CPU), deterministically.

Run from the repository root:

    /opt/torchenv/py tools/golden/make_golden.py            # write tests/data/*.txt
    /opt/torchenv/py tools/golden/make_golden.py --analyze  # also print the per-element
                                                           # formula analysis (evidence)
    /opt/torchenv/py tools/golden/make_golden.py --only sgd # write only sgd_torch.txt

tools/golden/setup_torch.sh recreates the interpreter. The files depend on torch's
version and on its CPU capability (the AVX2 build here: `torch.backends.cpu.
get_cpu_capability()`); both are written into every file's header and the script
refuses to run on another capability unless --any-capability is given.

The file format is tests/data/README.md's ("Format"). Every optimizer file
(<group>_torch.txt) has one format, in stepcore's names: a case names its optimizer
(OptimizerTraits' name), its hyper-parameters by OptimizerTraits' field names and its state
by the unit's slot names, so tests/test_golden.cpp reads every optimizer with one loader.
What ties those names to torch is OPTIMIZERS below, the one table of this script; FILES
lists each file's cases. A torch-backed optimizer added to stepcore gets golden data from
one OPTIMIZERS entry and a FILES entry with its cases (docs/adding-an-optimizer.md).
"""

import argparse
import atexit
import math
import os
import shutil
import sys
import tempfile
from fractions import Fraction

# torch.compile (torchao's steps) caches compiled kernels in one folder per user, keyed
# without the CPU capability: a kernel compiled here under ATEN_CPU_CAPABILITY=avx2 and
# later loaded by a process on an AVX-512 capability gave other bits and corrupted the heap
# (torch 2.15, torchao 0.18; docs/numerics.md 8e). So this script compiles into a folder
# of its own, removed when it exits.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _inductor_cache = tempfile.mkdtemp(prefix="make_golden_inductor_")
    atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache

import torch  # noqa: E402  (after the cache folder is set)

DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


# ---------------------------------------------------------------- bit helpers

def f32_words(t):
    """Space-separated 8-hex-digit words of a float32 tensor."""
    assert t.dtype == torch.float32
    u = t.detach().contiguous().view(torch.int32).tolist()
    return " ".join("%08x" % (x & 0xFFFFFFFF) for x in u)


def words(t):
    """A tensor's bit patterns: 8 hex digits per f32 element, 4 per bf16 or f16 element."""
    if t.dtype == torch.float32:
        return f32_words(t)
    assert t.dtype in (torch.bfloat16, torch.float16)
    u = t.detach().contiguous().view(torch.int16).tolist()
    return " ".join("%04x" % (x & 0xFFFF) for x in u)


def bits_list(t):
    return [x & 0xFFFFFFFF for x in t.detach().contiguous().view(torch.int32).tolist()]


def f32_bits_of(x):
    return bits_list(torch.tensor([x], dtype=torch.float32))[0]


def f32_value(x):
    """The f32 nearest to the double x, as a double."""
    return torch.tensor([x], dtype=torch.float32).item()


def line(key, *toks):
    return " ".join([key] + [str(t) for t in toks if str(t) != ""])


def tensor_line(key, idx, t):
    w = words(t)
    return f"{key} {idx} {w}" if w else f"{key} {idx}"


def same_bits(a, b):
    """Whether two tensors hold the same dtype and bit patterns."""
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


# ---------------------------------------------------------------- exact arithmetic

def f32_units(bits):
    """|x| = m * 2^-149 for the f32 bit pattern; returns the integer m."""
    e = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    assert e != 0xFF, "finite values only"
    return frac if e == 0 else (frac | 0x800000) << (e - 1)


def rn_f32_sqrt_units(s):
    """RN_f32(sqrt(s * 2^-298)) for an integer s >= 0, ties to even; returns f32 bits."""
    if s == 0:
        return 0
    r = math.isqrt(s)                    # floor(sqrt(s)); sqrt(s*2^-298) = sqrt(s)*2^-149
    e = r.bit_length() - 1 - 149         # 2^e <= result < 2^(e+1)
    ue = max(e - 23, -149)               # exponent of the result's ulp (subnormal grid floor)
    j = ue + 149                         # result / 2^ue = sqrt(s) / 2^j
    q = r >> j                           # floor(sqrt(s) / 2^j)
    # Compare sqrt(s)/2^j with q + 1/2, i.e. 4s with (2q+1)^2 * 4^j (exact integers).
    lhs, rhs = 4 * s, (2 * q + 1) ** 2 << (2 * j)
    if lhs > rhs or (lhs == rhs and q & 1):
        q += 1
    value = Fraction(q) * Fraction(2) ** ue
    if value >= Fraction(2) ** 128:      # rounded past the largest finite f32
        return 0x7F800000
    return f32_bits_of(float(value))     # value is an exact f32 (and double) here


def exact_norm_bits(tensors):
    s = 0
    for t in tensors:
        for b in bits_list(t):
            m = f32_units(b & 0x7FFFFFFF)
            s += m * m
    return rn_f32_sqrt_units(s)


def rn32(q):
    """Round a rational to binary32, nearest-even; returns a Python float (finite only)."""
    q = Fraction(q)
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    ue = max(e, -126) - 23
    m = a / Fraction(2) ** ue
    fl = m.numerator // m.denominator
    rem = m - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl & 1):
        fl += 1
    return sign * float(fl * Fraction(2) ** ue)


def fma32(a, b, c):
    """Exact fused multiply-add of f32 values (as Python floats), rounded once."""
    r = Fraction(a) * Fraction(b) + Fraction(c)
    if r != 0:
        return rn32(r)
    prod_neg = (math.copysign(1.0, a) * math.copysign(1.0, b)) < 0
    if Fraction(a) * Fraction(b) == 0 and c == 0:
        return -0.0 if (prod_neg and math.copysign(1.0, c) < 0) else 0.0
    return 0.0


def fma32_array(a, b, c):
    """Elementwise fma of f32 numpy arrays, rounded once: the double sum where it is exact
    (checked with TwoSum), fma32's exact arithmetic elsewhere."""
    import numpy as np
    a, b, c = np.broadcast_arrays(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  np.asarray(c, np.float32))
    prod = a.astype(np.float64) * b.astype(np.float64)      # exact: 24 + 24 bits
    cd = c.astype(np.float64)
    s = prod + cd
    bb = s - prod
    err = (prod - (s - bb)) + (cd - bb)
    r = s.astype(np.float32)
    for i in np.nonzero(err != 0)[0]:
        r[i] = fma32(float(a[i]), float(b[i]), float(c[i]))
    return r


def double_fma(a, b, c):
    """RN_double(a*b + c) for doubles, exactly (Fractions)."""
    return float(Fraction(a) * Fraction(b) + Fraction(c))


# ---------------------------------------------------------------- the optimizers: one table

class PlainSignSgd(torch.optim.Optimizer):
    """The SignSGD a trainer writes in plain PyTorch (torch.optim has none), on the widened
    gradient (torch.sign of a bf16 gradient gives the same bits: check_sign_and_add):

        if wd > 0: p.add_(p, alpha=-lr*wd)
        p.add_(torch.sign(g), alpha=-lr)
    """

    def __init__(self, params, lr, weight_decay):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if wd > 0:
                    p.add_(p, alpha=-lr * wd)
                p.add_(torch.sign(p.grad), alpha=-lr)


def fused(cls):
    """A torch.optim class with fused=True (its fused CPU kernel)."""
    return lambda params, **kw: cls(params, fused=True, **kw)


def same_names(hp):
    """Hyper-parameters whose names torch shares."""
    return dict(hp)


def adamw_make(params, formula="torch", **kw):
    """AdamW by stepcore's formula: torch's fused kernel, or for "torchao" torchao's
    AdamW8bit (pinned by tools/setup-python.sh), whose tensors below 4,096 elements keep f32
    state: the torchao formula's element arithmetic on unquantized state."""
    if formula == "torchao":
        from torchao.optim import AdamW8bit
        assert not kw.pop("maximize"), "torchao's AdamW8bit has no maximize"
        return AdamW8bit(params, **kw)
    return torch.optim.AdamW(params, fused=True, **kw)


def adam_make(params, formula="torch", **kw):
    """Adam by stepcore's formula: torch's fused kernel, or for "torchao" torchao's
    Adam8bit, whose tensors below 4,096 elements keep f32 state (as adamw_make's)."""
    if formula == "torchao":
        from torchao.optim import Adam8bit
        assert not kw.pop("maximize"), "torchao's Adam8bit has no maximize"
        return Adam8bit(params, **kw)
    return torch.optim.Adam(params, fused=True, **kw)


def adamw_names(hp):
    """adam_names, keeping `formula` (adamw_make and adam_make pick the implementation by
    it)."""
    kw = adam_names(hp)
    kw["formula"] = hp["formula"]
    return kw


def adam_names(hp):
    """The Adam family's: beta1 and beta2 as torch's betas; `formula` is stepcore's (which
    arithmetic it reproduces: torch's), not torch's."""
    kw = {k: v for k, v in hp.items() if k != "formula"}
    kw["betas"] = (kw.pop("beta1"), kw.pop("beta2"))
    return kw


# Every optimizer torch runs for the golden files, by its OptimizerTraits name
# (include/stepcore/optim.hpp): `make` builds torch's optimizer from the keyword arguments
# `args` gives for the hyper-parameters; `fields` are OptimizerTraits' fields in their order
# (the machine ones left out: the golden set is the torch build), `defaults` fills those a
# case does not give; `slots` are the unit's state slots in their order (core/optimizers:
# kSlotNames, torch's state keys too: run_case asserts it) and `used(hp)` how many of them
# the configuration uses (the unit's slots(variant)). Lion has none: torch has no Lion.
OPTIMIZERS = {
    "adamw": dict(make=adamw_make, args=adamw_names,
                  fields=["lr", "beta1", "beta2", "eps", "weight_decay", "formula", "amsgrad",
                          "maximize"],
                  defaults=dict(formula="torch", amsgrad=False, maximize=False),
                  slots=["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
                  used=lambda hp: 3 if hp["amsgrad"] else 2),
    "sign_sgd": dict(make=PlainSignSgd, args=same_names, fields=["lr", "weight_decay"],
                     defaults={}, slots=[], used=lambda hp: 0),
    "adam": dict(make=adam_make, args=adamw_names,
                 fields=["lr", "beta1", "beta2", "eps", "weight_decay", "formula", "amsgrad",
                         "maximize"],
                 defaults=dict(formula="torch", amsgrad=False, maximize=False),
                 slots=["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
                 used=lambda hp: 3 if hp["amsgrad"] else 2),
    "sgd": dict(make=fused(torch.optim.SGD), args=same_names,
                fields=["lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"],
                defaults=dict(dampening=0.0, nesterov=False, maximize=False),
                slots=["momentum_buffer"], used=lambda hp: 1 if hp["momentum"] != 0 else 0),
    "adagrad": dict(make=fused(torch.optim.Adagrad), args=same_names,
                    fields=["lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps",
                            "maximize"],
                    defaults=dict(maximize=False), slots=["sum"], used=lambda hp: 1),
}


def hparams(opt, hp):
    """Every field of optimizer `opt` in its order: the value given in hp, else the default."""
    spec = OPTIMIZERS[opt]
    unknown = set(hp) - set(spec["fields"])
    assert not unknown, f"{opt}: no hyper-parameters {sorted(unknown)}"
    out = {}
    for k in spec["fields"]:
        assert k in hp or k in spec["defaults"], f"{opt}: hyper-parameter {k} missing"
        out[k] = hp.get(k, spec["defaults"].get(k))
    return out


def used_slots(opt, hp):
    """The state slots optimizer `opt` keeps with hyper-parameters hp (every field given)."""
    spec = OPTIMIZERS[opt]
    return spec["slots"][:spec["used"](hp)]


def make_optimizer(opt, params, hp):
    """torch's optimizer `opt` over params, with hyper-parameters hp (stepcore's names)."""
    spec = OPTIMIZERS[opt]
    return spec["make"](params, **spec["args"](hparams(opt, hp)))


def hparam_token(v):
    """A hyper-parameter as the files write it: a flag 0|1, a name, or a double's hex."""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, str):
        return v
    return float(v).hex()


def hparam_decimal(v):
    """The same for a comment a reader reads: doubles as Python prints them."""
    return repr(float(v)) if not isinstance(v, (bool, str)) else hparam_token(v)


# ---------------------------------------------------------------- inputs
#
# Each case's `inputs(gen, case)` returns its initial parameters (in the param dtype) and a
# function giving the gradients of step s (1-based, in the gradient dtype), drawn from the
# case's generator in that order.

def make_grad(gen, n, scale, dtype, specials):
    g = torch.randn(n, generator=gen, dtype=torch.float32) * scale
    if specials and n >= 4:
        # exact zeros of both signs, a tiny and a large value
        idx = torch.randperm(n, generator=gen)[:4].tolist()
        g[idx[0]] = 0.0
        g[idx[1]] = -0.0
        g[idx[2]] = 3.0e-30 * scale
        g[idx[3]] = -1.0e3 * scale
    return g.to(dtype)


def moments_inputs(gen, case):
    """AdamW's and Adam's: parameters ~N(0, 0.25); gradients ~N(0, 1) times the step's
    scale with, when `specials`, exact +-0, a tiny and a large element, in the case's gradient
    dtype; NaN in the first and the last element of every tensor at step `nan_step`."""
    init = [torch.randn(n, generator=gen) * 0.5 for n in case["sizes"]]

    def grads(s):
        gs = [make_grad(gen, n, case["scales"][s - 1], grad_dtype(case), case["specials"])
              for n in case["sizes"]]
        if case.get("nan_step") == s:
            for g in gs:
                if g.numel():
                    g[0] = float("nan")
                    g[-1] = float("nan")
        return gs
    return init, grads


def adagrad_init(gen, sizes):
    """Random parameters with a +0 and a -0 in each tensor of 3+ elements (their indices
    are returned, so the first step can give them zero gradients)."""
    params, zeros = [], []
    for n in sizes:
        p = torch.randn(n, generator=gen) * 0.5
        z = None
        if n >= 3:
            idx = torch.randperm(n, generator=gen)[:2].tolist()
            p[idx[0]] = 0.0
            p[idx[1]] = -0.0
            z = idx
        params.append(p)
        zeros.append(z)
    return params, zeros


def adagrad_inputs(gen, case):
    """Adagrad's: adagrad_init's parameters; AdamW's gradients (with the specials), the
    zero parameters given +-0 gradients in step 1."""
    init, zeros = adagrad_init(gen, case["sizes"])

    def grads(s):
        gs = [make_grad(gen, n, case["scales"][s - 1], torch.float32, True) for n in case["sizes"]]
        if s == 1:  # zero gradients of both signs on the zero parameters
            for t, z in enumerate(zeros):
                if z is not None:
                    gs[t][z[0]] = -0.0
                    gs[t][z[1]] = 0.0 if t % 2 == 0 else -0.0
        return gs
    return init, grads


def fma_discriminating_params(gen, count, c):
    """f32 values p for which fma(p, c, p) != p + RN(p*c): they tell an FMA decay apart."""
    found = []
    while len(found) < count:
        xs = torch.randn(4096, generator=gen)
        sep = xs + xs * c
        dbl = (xs.double() * float(c) + xs.double()).float()  # candidates only
        for i in torch.nonzero(sep != dbl).flatten().tolist():
            x = xs[i].item()
            if f32_bits_of(fma32(x, float(c), x)) != f32_bits_of(sep[i].item()):
                found.append(x)
    return found[:count]


def sign_sgd_init(gen, case):
    """Initial parameters: random, one +0 and one -0 per tensor (their indices are returned),
    and, with weight decay, a quarter of values whose decay rounds differently with and
    without an FMA."""
    lr, wd = case["hp"]["lr"], case["hp"]["weight_decay"]
    params = [torch.randn(n, generator=gen) for n in case["sizes"]]
    c = f32_value(-lr * wd) if wd > 0 else None
    zeros = []
    for p in params:
        n = p.numel()
        idx = torch.randperm(n, generator=gen).tolist()
        if n >= 3:
            p[idx[0]] = 0.0
            p[idx[1]] = -0.0
            zeros.append((idx[0], idx[1]))
        else:
            zeros.append(None)
        if c is not None and n >= 8:
            k = n // 4
            vals = fma_discriminating_params(gen, k, torch.tensor(c, dtype=torch.float32))
            for j, v in zip(idx[2:2 + k], vals):
                p[j] = v
    return params, zeros


def sign_sgd_grad(gen, n, dtype, nan=False):
    g = torch.randn(n, generator=gen)
    kind = torch.randint(0, 10, (n,), generator=gen)
    g[kind == 0] = 0.0
    g[kind == 1] = -0.0
    g[kind == 2] *= 1e-30          # tiny: still a sign (bf16 keeps it)
    if nan:
        g[kind == 3] = float("nan")
    return g.to(dtype)


def sign_sgd_inputs(gen, case):
    """SignSGD's: sign_sgd_init's parameters; gradients ~N(0, 1) with exact +0 and -0 (10 %
    each) and tiny ones (10 %), NaN (10 %) when `nan`; the zero parameters given +-0
    gradients in step 1, so sign(+-0) and the sign of the zero sum p + sign(g) * -lr show."""
    init, zeros = sign_sgd_init(gen, case)

    def grads(s):
        gs = [sign_sgd_grad(gen, n, grad_dtype(case), case.get("nan", False))
              for n in case["sizes"]]
        if s == 1:
            for t, z in enumerate(zeros):
                if z is not None:
                    gs[t][z[0]] = -0.0
                    gs[t][z[1]] = -0.0 if t % 2 == 0 else 0.0
        return gs
    return init, grads


def sgd_grad(gen, n, scale):
    """Gradients of magnitude ~scale (each element times 0.1, 1 or 10), with exact +0 and
    -0 (10 % each) and tiny values (10 %, times 1e-30)."""
    g = torch.randn(n, generator=gen) * scale
    g *= 10.0 ** torch.randint(-1, 2, (n,), generator=gen).float()
    kind = torch.randint(0, 10, (n,), generator=gen)
    g[kind == 0] = 0.0
    g[kind == 1] = -0.0
    g[kind == 2] *= 1e-30
    return g


def standard_inputs(gen, case):
    """The inputs a new optimizer's cases can take: parameters ~N(0, 0.25), each tensor of
    3+ elements starting with a +0 and a -0, rounded to the param dtype; sgd_grad's
    gradients (x0.1/1/10, +-0, tiny) times the step's scale, rounded to the gradient dtype."""
    init = []
    for n in case["sizes"]:
        p = torch.randn(n, generator=gen) * 0.5
        if n >= 3:
            p[0], p[1] = 0.0, -0.0
        init.append(p.to(param_dtype(case)))

    def grads(s):
        return [sgd_grad(gen, n, case["scales"][s - 1]).to(grad_dtype(case))
                for n in case["sizes"]]
    return init, grads


# ---------------------------------------------------------------- the cases
#
# A case: name, opt (an OPTIMIZERS key), hp (its hyper-parameters by stepcore's names; the
# defaults fill the rest), sizes, seed, inputs, scales (one gradient scale per step; its
# length is the step count), dtype (the param dtype, default f32), gdtype (the gradient
# dtype, default the param's), and what its inputs read.

def param_dtype(case):
    return case.get("dtype", torch.float32)


def grad_dtype(case):
    return case.get("gdtype", param_dtype(case))


SIZES_FULL = [1, 7, 8, 13, 16, 31, 33, 100, 257, 1025]
SIZES_SMALL = [1, 7, 8, 13, 16, 31, 33, 100, 257]


def adamw_cases():
    def hp(lr, b1, b2, eps, wd):
        return dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
    common = dict(opt="adamw", inputs=moments_inputs)
    return [
        dict(common, name="f32_default_wd", gdtype=torch.float32, sizes=SIZES_FULL, seed=101,
             hp=hp(1e-3, 0.9, 0.999, 1e-8, 0.01), scales=[1.0, 1e-2, 10.0, 1.0, 1e-4],
             specials=True),
        dict(common, name="f32_beta1_0.3_wd0", gdtype=torch.float32, sizes=SIZES_SMALL, seed=102,
             hp=hp(1e-2, 0.3, 0.95, 1e-8, 0.0), scales=[1.0, 0.1, 1.0, 5.0, 1.0], specials=True),
        dict(common, name="f32_beta1_0.5_wd", gdtype=torch.float32, sizes=SIZES_SMALL, seed=103,
             hp=hp(3e-3, 0.5, 0.99, 1e-6, 0.1), scales=[1.0, 2.0, 1e-3, 1.0, 1.0],
             specials=False),
        dict(common, name="bf16_default_wd0", gdtype=torch.bfloat16, sizes=SIZES_FULL, seed=104,
             hp=hp(1e-3, 0.9, 0.999, 1e-8, 0.0), scales=[1.0, 1.0, 1e-2, 10.0, 1.0],
             specials=True),
        dict(common, name="bf16_beta1_0.3_wd", gdtype=torch.bfloat16, sizes=SIZES_SMALL, seed=105,
             hp=hp(1e-2, 0.3, 0.999, 1e-8, 0.05), scales=[1.0, 0.5, 1.0, 1.0, 3.0],
             specials=True),
    ]


SIZES_ADAGRAD = [0, 1, 7, 8, 9, 31, 32, 33, 1023, 1024, 1025]
SIZES_ADAGRAD_SMALL = [0, 1, 7, 8, 9, 31, 32, 33, 100]


def clr_candidates(lr, lr_decay, step):
    """f32(clr) with the denominator 1 + (step-1)*lr_decay rounded twice and once (FMA)."""
    two = lr / (1.0 + (step - 1.0) * lr_decay)
    one = float(Fraction(lr) / Fraction(double_fma(step - 1.0, lr_decay, 1.0)))
    return f32_value(two), f32_value(one)


def clr_fma_lr(lr_decay, steps, near):
    """A deterministic lr near `near` for which f32(clr) tells the two denominators apart
    at some step <= steps (searched on f32 rounding midpoints)."""
    import numpy as np
    f = np.float32(near)
    for _ in range(100000):
        f = np.nextafter(f, np.float32(1))
        mid = (Fraction(float(f)) + Fraction(float(np.nextafter(f, np.float32(1))))) / 2
        for s in range(2, steps + 1):
            d_two = 1.0 + (s - 1.0) * lr_decay
            d_one = double_fma(s - 1.0, lr_decay, 1.0)
            if d_two == d_one:
                continue
            lr = float(mid * Fraction((d_two + d_one) / 2))
            a, b = clr_candidates(lr, lr_decay, s)
            if a != b:
                return lr
    raise RuntimeError("no lr found")


def adagrad_case(name, sizes, seed, scales, lr, lr_decay, wd, iav, eps, maximize):
    return dict(name=name, opt="adagrad", inputs=adagrad_inputs, sizes=sizes, seed=seed,
                scales=scales, hp=dict(lr=lr, lr_decay=lr_decay, weight_decay=wd,
                                       initial_accumulator_value=iav, eps=eps, maximize=maximize))


def adagrad_cases():
    full, small = SIZES_ADAGRAD, SIZES_ADAGRAD_SMALL
    lr_decay = 0.047  # its two denominators differ at step 6 (case clr_fma)
    return [
        adagrad_case("default", full, 401, [1.0, 1e-2, 10.0], 1e-2, 0.0, 0.0, 0.0, 1e-10, False),
        adagrad_case("iav0.1_wd_lr_decay", full, 402, [1.0, 3.0, 1e-3], 1e-2, 1e-3, 0.1, 0.1,
                     1e-10, False),
        adagrad_case("maximize_wd_eps1e-6", small, 403, [1.0, 0.1, 10.0, 1.0, 1e-4], 5e-2, 1e-2,
                     1e-2, 0.0, 1e-6, True),
        adagrad_case("iav0.1_eps1e-3_lr_decay0.5", small, 404, [1.0, 1e-2, 1.0, 5.0, 1.0], 1e-1,
                     0.5, 0.0, 0.1, 1e-3, False),
        adagrad_case("maximize_iav0.1_wd0.5_eps0", small, 405, [1.0, 1.0, 1e-3, 10.0, 1.0, 0.5],
                     1e-2, 0.0, 0.5, 0.1, 0.0, True),
        adagrad_case("wd_iav0_eps1e-8", small, 406, [1.0, 10.0, 0.1, 1.0, 1.0], 3e-3, 0.0, 0.3,
                     0.0, 1e-8, False),
        adagrad_case("clr_fma", small, 407, [1.0] * 6, clr_fma_lr(lr_decay, 6, 1e-2), lr_decay,
                     0.0, 0.0, 1e-10, False),
    ]


SIZES_ADAM_FULL = [0, 1, 7, 8, 9, 31, 32, 33, 1023, 1024, 1025]
SIZES_ADAM_SMALL = [0, 1, 7, 8, 9, 31, 32, 33, 100]


def adam_case(name, opt, ams, maxi, sizes, seed, scales, lr, betas, eps, wd, specials=True,
              **extra):
    return dict(name=name, opt=opt, inputs=moments_inputs, sizes=sizes, seed=seed,
                scales=scales, specials=specials,
                hp=dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd,
                        amsgrad=ams, maximize=maxi), **extra)


def torchao_cases_of(opt, prefix, seed, decays, amsgrad_name):
    """torchao's 8-bit class of `opt` (adamw_make, adam_make) on tensors below its
    4,096-element threshold (f32 state), the optimizer's torchao formula (docs/numerics.md
    8e): three cases named `prefix` + what they cover, seeds from `seed`, weight decays
    `decays` (one per case): the default betas with the largest tensors and ±0, tiny and
    large gradient elements; betas (0.3, 0.4) with amsgrad (both lerp forms of m and v);
    bf16 gradients."""
    def hp(lr, b1, b2, eps, wd, amsgrad=False):
        return dict(lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, formula="torchao",
                    amsgrad=amsgrad)
    common = dict(opt=opt, inputs=moments_inputs)
    return [
        dict(common, name=prefix + "f32_default", gdtype=torch.float32, sizes=SIZES_FULL,
             seed=seed, hp=hp(1e-3, 0.9, 0.999, 1e-8, decays[0]),
             scales=[1.0, 1e-2, 10.0, 1.0, 1e-4], specials=True),
        dict(common, name=prefix + amsgrad_name, gdtype=torch.float32, sizes=SIZES_SMALL,
             seed=seed + 1, hp=hp(1e-2, 0.3, 0.4, 1e-8, decays[1], amsgrad=True),
             scales=[1.0, 0.1, 1.0, 5.0, 1.0], specials=True),
        dict(common, name=prefix + "bf16_grads_wd", gdtype=torch.bfloat16, sizes=SIZES_SMALL,
             seed=seed + 2, hp=hp(3e-3, 0.5, 0.99, 1e-6, decays[2]),
             scales=[1.0, 2.0, 1e-3, 1.0, 1.0], specials=False),
    ]


def torchao_cases():
    """AdamW8bit: decoupled decay 0.01, none with amsgrad, 0.1."""
    return torchao_cases_of("adamw", "torchao_", 701, (0.01, 0.0, 0.1),
                            "wd0_beta1_0.3_beta2_0.4_amsgrad")


def adam_torchao_cases():
    """Adam8bit: L2 decay into the gradient, none first, then 0.05 with amsgrad, 0.1."""
    return torchao_cases_of("adam", "adam_torchao_", 711, (0.0, 0.05, 0.1),
                            "wd_beta1_0.3_beta2_0.4_amsgrad")


def adam_cases():
    d = (0.9, 0.999)
    full, small = SIZES_ADAM_FULL, SIZES_ADAM_SMALL
    return [
        adam_case("adam_wd_full", "adam", False, False, full, 401, [1.0, 1e-2], 1e-3, d, 1e-8, 0.1),
        adam_case("adam_ams_max_wd_beta1_0.3_full", "adam", True, True, full, 402, [1.0, 1e-2],
                  3e-3, (0.3, 0.95), 1e-8, 0.37),
        adam_case("adam_wd0", "adam", False, False, small, 403, [1.0, 0.1, 10.0, 1e-4], 1e-2, d,
                  1e-8, 0.0),
        adam_case("adam_ams_wd", "adam", True, False, small, 404, [1.0, 1e-2, 3.0, 1e-3], 1e-3, d,
                  1e-8, 0.01),
        adam_case("adam_max_wd0_beta1_0.5", "adam", False, True, small, 405,
                  [1.0, 2.0, 1e-3, 1.0], 1e-2, (0.5, 0.99), 1e-6, 0.0),
        adam_case("adam_max_wd", "adam", False, True, small, 406, [1.0, 0.5, 1e-2, 1.0], 1e-3,
                  (0.8, 0.9), 1e-8, 0.3),
        adam_case("adamw_ams_wd", "adamw", True, False, small, 407, [1.0, 1e-2, 3.0, 1e-3], 1e-3,
                  d, 1e-8, 0.01),
        adam_case("adamw_max_beta1_0.3", "adamw", False, True, small, 408, [1.0, 0.1, 1.0, 5.0],
                  1e-2, (0.3, 0.999), 1e-8, 0.1),
        adam_case("adamw_ams_max_wd0", "adamw", True, True, small, 409, [1.0, 1e-3, 1.0, 1e-2],
                  1e-2, (0.9, 0.99), 1e-8, 0.0),
        adam_case("adamw_ams_max_wd_full", "adamw", True, True, full, 410, [1.0, 1e-2], 1e-3, d,
                  1e-8, 0.05),
        # NaN gradients in step 2: amsgrad's maximum propagates NaN in torch's vector body
        # and keeps the old maximum in its scalar tail (std::max with a NaN second operand)
        adam_case("adam_ams_wd_nan", "adam", True, False, [7, 9, 16, 17], 411, [1.0, 1.0, 1.0],
                  1e-3, d, 1e-8, 0.01, specials=False, nan_step=2),
    ]


def sign_sgd_cases():
    def case(name, gdtype, sizes, lr, wd, seed, steps=3, **extra):
        return dict(name=name, opt="sign_sgd", inputs=sign_sgd_inputs, gdtype=gdtype,
                    sizes=sizes, seed=seed, scales=[1.0] * steps,
                    hp=dict(lr=lr, weight_decay=wd), **extra)
    return [
        case("f32_wd0", torch.float32, SIZES_FULL, 1e-3, 0.0, 201),
        case("f32_wd", torch.float32, SIZES_SMALL, 5e-2, 0.5, 202),
        case("bf16_wd", torch.bfloat16, SIZES_FULL, 1e-2, 0.01, 203),
        case("bf16_wd0", torch.bfloat16, SIZES_SMALL, 3e-4, 0.0, 204),
        # NaN gradients: torch.sign(NaN) = +0, a deliberate difference (docs/numerics.md 8)
        case("f32_nan_grad", torch.float32, [7, 33], 1e-2, 0.1, 205, steps=1, nan=True),
    ]


SGD_SIZES_FULL = [0, 1, 7, 8, 9, 31, 32, 33, 1023, 1024, 1025]
SGD_SIZES_SMALL = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33]


def sgd_cases():
    def case(name, sizes, lr, mom, damp, wd, nest, maxi, seed, scales):
        return dict(name=name, opt="sgd", inputs=standard_inputs, sizes=sizes, seed=seed,
                    scales=scales, hp=dict(lr=lr, momentum=mom, dampening=damp, weight_decay=wd,
                                           nesterov=nest, maximize=maxi))
    F, S = SGD_SIZES_FULL, SGD_SIZES_SMALL
    return [
        case("mom0_wd0", F, 1e-2, 0.0, 0.0, 0.0, False, False, 401, [1.0, 1e-3, 10.0]),
        case("mom0.9_damp0.1_wd", F, 0.1, 0.9, 0.1, 0.05, False, False, 402, [1.0, 0.1, 3.0]),
        case("nesterov_wd_maximize", F, 3e-2, 0.9, 0.0, 0.1, True, True, 403, [0.1, 1.0, 0.01]),
        case("mom0.9_plain", S, 1e-3, 0.9, 0.0, 0.0, False, False, 404, [1.0, 0.5, 2.0, 1e-4]),
        case("mom0.9_damp0.1_maximize", S, 0.1, 0.9, 0.1, 0.0, False, True, 405,
             [1.0, 10.0, 0.1, 1.0]),
        case("mom0_wd_maximize", S, 0.1, 0.0, 0.0, 0.1, False, True, 406, [0.05, 1.0, 0.1, 1.0]),
        case("nesterov_0.5_wd", S, 5e-2, 0.5, 0.0, 0.01, True, False, 407, [1.0, 0.01, 1.0, 0.1]),
        case("mom0.99_damp0.5_wd", S, 1e-2, 0.99, 0.5, 1e-4, False, False, 408,
             [1.0, 1.0, 1e-2, 5.0]),
    ]


LOWP_SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 100]
LOWP_SIZES_FULL = LOWP_SIZES + [1023, 1024, 1025]
LOWP_TAIL_SIZES = [15] * 40 + [31] * 20 + [9] * 20   # mostly tail: W' = 16 against 8


def lowp_cases():
    """Each configuration with bf16 and with f16 params (gradients and state in the param's
    dtype), the f16 one drawn from seed + 50."""
    configs = [
        ("adam_default", "adam", LOWP_SIZES_FULL, 601, 3,
         dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)),
        ("adam_l2_amsgrad", "adam", LOWP_SIZES, 602, 5,
         dict(lr=1e-2, beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.1, amsgrad=True)),
        ("adam_maximize_tail", "adam", LOWP_TAIL_SIZES, 603, 6,
         dict(lr=1e-2, beta1=0.3, beta2=0.6, eps=1e-8, weight_decay=0.0, maximize=True)),
        ("adamw_wd", "adamw", LOWP_SIZES_FULL, 604, 3,
         dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)),
        ("adamw_amsgrad_maximize", "adamw", LOWP_SIZES, 605, 5,
         dict(lr=3e-3, beta1=0.5, beta2=0.99, eps=1e-8, weight_decay=0.1, amsgrad=True,
              maximize=True)),
        ("sgd_plain", "sgd", LOWP_SIZES, 606, 4,
         dict(lr=1e-1, momentum=0.0, dampening=0.0, weight_decay=0.0)),
        ("sgd_momentum_wd", "sgd", LOWP_SIZES_FULL, 607, 3,
         dict(lr=1e-1, momentum=0.9, dampening=0.1, weight_decay=0.05)),
        ("sgd_nesterov_maximize_tail", "sgd", LOWP_TAIL_SIZES, 608, 6,
         dict(lr=3e-2, momentum=0.9, dampening=0.0, weight_decay=0.1, nesterov=True,
              maximize=True)),
        ("adagrad_default", "adagrad", LOWP_SIZES_FULL, 609, 3,
         dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10)),
        ("adagrad_decay_iav_maximize", "adagrad", LOWP_SIZES, 610, 5,
         dict(lr=5e-2, lr_decay=1e-2, weight_decay=1e-2, initial_accumulator_value=0.1, eps=1e-6,
              maximize=True)),
    ]
    cases = []
    for name, opt, sizes, seed, steps, hp in configs:
        for dtype, offset in ((torch.bfloat16, 0), (torch.float16, 50)):
            cases.append(dict(name=f"{name}_{DTYPE_NAMES[dtype]}", opt=opt, dtype=dtype,
                              inputs=standard_inputs, sizes=sizes, seed=seed + offset,
                              scales=[1.0] * steps, hp=hp))
    return cases


# Every optimizer file, by its --only name: the file, the comment lines under its header,
# and its cases (each in the file's order).
FILES = {
    "adamw": ("adamw_torch.txt",
              ["# torch.optim.AdamW(fused=True) on CPU, f32 params; f32 and bf16 gradients (torch",
               "# was given their exact f32 widening)."], adamw_cases),
    "adam": ("adam_torch.txt",
             ["# torch.optim.Adam / AdamW(fused=True) on CPU with amsgrad and maximize, f32 params",
              "# and gradients."], adam_cases),
    "torchao": ("adamw_torchao.txt",
                ["# torchao.optim.AdamW8bit on CPU (torch.compile's kernel) over tensors below its",
                 "# 4,096-element threshold, so with f32 state: the torchao formula; f32 params."],
                torchao_cases),
    "adam_torchao": ("adam_torchao.txt",
                     ["# torchao.optim.Adam8bit on CPU (torch.compile's kernel) over tensors below its",
                      "# 4,096-element threshold, so with f32 state: Adam's torchao formula; f32",
                      "# params."],
                     adam_torchao_cases),
    "sign_sgd": ("sign_sgd_torch.txt",
                 ["# The plain PyTorch SignSGD a trainer writes, f32 params:",
                  "#   if wd > 0: p.add_(p, alpha=-lr*wd);  p.add_(torch.sign(g), alpha=-lr)",
                  "# Case f32_nan_grad has NaN gradients: torch.sign(NaN) = 0 (see README)."],
                 sign_sgd_cases),
    "sgd": ("sgd_torch.txt", ["# torch.optim.SGD(fused=True) on CPU, f32 params and gradients."],
            sgd_cases),
    "adagrad": ("adagrad_torch.txt",
                ["# torch.optim.Adagrad(fused=True) on CPU, f32 params and gradients."],
                adagrad_cases),
    "lowp": ("lowp_torch.txt",
             ["# torch.optim.Adam / AdamW / SGD / Adagrad(fused=True) on CPU with bf16 and f16",
              "# params: gradients and state in the param's dtype (docs/numerics.md 7.3)."],
             lowp_cases),
}


# ---------------------------------------------------------------- the writer

def run_case(case, threads):
    """Runs a case's optimizer in torch with `threads` threads. Returns its initial params
    ("init"), the slots torch fills at construction ("init_state": slot -> tensors), and
    per step the gradients given ("grads"), the params after the step ("param"), every used
    slot by its name, and torch's f32 state['step'] where torch keeps one ("step")."""
    torch.set_num_threads(threads)
    hp = hparams(case["opt"], case["hp"])
    slots = used_slots(case["opt"], hp)
    gen = torch.Generator().manual_seed(case["seed"])
    init, grads_of = case["inputs"](gen, case)
    params = [torch.nn.Parameter(p.clone()) for p in init]
    opt = make_optimizer(case["opt"], params, hp)
    out = {"init": [p.detach().clone() for p in params], "steps": [],
           "init_state": {k: [opt.state[p][k].clone() for p in params] for k in slots
                          if all(k in opt.state[p] for p in params)}}
    for s in range(1, len(case["scales"]) + 1):
        grads = grads_of(s)
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype, copy=True)   # exact widening of a bf16 gradient
        opt.step()
        rec = {"grads": grads, "param": [p.detach().clone() for p in params], "step": []}
        for p, g in zip(params, grads):
            assert same_bits(p.grad, g.to(p.dtype)), f"{case['name']}: the step wrote the gradient"
            state = {k for k, v in opt.state[p].items() if k != "step" and v is not None}
            assert state == set(slots), f"{case['name']}: torch's state {sorted(state)}, not {slots}"
        for k in slots:
            rec[k] = [opt.state[p][k].clone() for p in params]
            assert all(x.dtype == p.dtype for x, p in zip(rec[k], params)), \
                f"{case['name']}: {k} is not in the param's dtype"
        if all("step" in opt.state[p] for p in params):
            for p in params:
                st = opt.state[p]["step"]
                assert st.dtype == torch.float32
                rec["step"].append(st.clone().reshape(1))
        out["steps"].append(rec)
    return out


def write_optimizer_file(path, header, title, cases):
    """Writes an optimizer file (tests/data/README.md, "Format"): each case run with 1 and
    with 2 torch threads (asserted to give the same bits), the first run written."""
    lines = list(header) + list(title)
    for case in cases:
        a = run_case(case, 1)
        b = run_case(case, 2)
        for ra, rb in zip(a["steps"], b["steps"]):
            for key in ra:
                if key != "grads":
                    assert all(same_bits(x, y) for x, y in zip(ra[key], rb[key])), \
                        f"{case['name']}: thread count changed {key}"
        torch.set_num_threads(1)
        hp = hparams(case["opt"], case["hp"])
        slots = used_slots(case["opt"], hp)
        K, S = len(case["sizes"]), len(case["scales"])
        lines.append(f"# seed {case['seed']}: " +
                     " ".join(f"{k}={hparam_decimal(v)}" for k, v in hp.items()))
        lines.append(line("case", case["name"], case["opt"], DTYPE_NAMES[param_dtype(case)],
                          DTYPE_NAMES[grad_dtype(case)], K, S))
        lines.append(line("hparams", *(f"{k}={hparam_token(v)}" for k, v in hp.items())))
        lines.append(line("sizes", *case["sizes"]))
        for t, p in enumerate(a["init"]):
            lines.append(tensor_line("init_param", t, p))
        for k in slots:
            for t, x in enumerate(a["init_state"].get(k, [])):
                lines.append(tensor_line("init_" + k, t, x))
        for s, rec in enumerate(a["steps"], start=1):
            lines.append(line("step", s))
            for key in ["grads", "param"] + slots:
                for t, x in enumerate(rec[key]):
                    lines.append(tensor_line("grad" if key == "grads" else key, t, x))
            for t, x in enumerate(rec["step"]):
                lines.append(tensor_line("step_count", t, x))
        lines.append("end")
    write(path, lines)


class CandidateTally:
    """The analysers' evidence: per region (body, tail) and candidate formula, how many
    elements were compared and how many of them the candidate reproduced."""

    def __init__(self):
        self.counts = {}

    def score(self, region, cands, want_bits, always=False):
        """Scores every candidate's result (name -> value, rounded to f32 here) against
        torch's bits: on every element when `always`, else only where they disagree."""
        got = {k: f32_bits_of(float(x)) for k, x in cands.items()}
        if always or len(set(got.values())) > 1:
            for k, b in got.items():
                tot, ok = self.counts.get((region, k), (0, 0))
                self.counts[(region, k)] = (tot + 1, ok + (b == want_bits))

    def print(self, width):
        """Prints a line per region and candidate: matches / elements compared."""
        for (region, k), (tot, ok) in sorted(self.counts.items()):
            print(f"  {region:4s} {k:{width}s} {ok:6d} / {tot}")


# ---------------------------------------------------------------- evidence: AdamW

def analyze_adamw():
    """Per element, which rounding of m, v and p reproduces torch: the evidence behind the
    torch formula. numpy float32 scalars for the correctly rounded operations (torch.sqrt
    on f32 tensors is not correctly rounded on CPU, so it is not used here), Fractions for
    exact FMAs. body = the first numel - numel % 8 elements, tail = the rest."""
    import numpy as np
    F = np.float32
    for case in adamw_cases():
        a = run_case(case, 1)
        hp = case["hp"]
        lr, b1, b2, eps, wd = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"]
        tally = CandidateTally()

        prev = {"param": a["init"], "exp_avg": [torch.zeros(n) for n in case["sizes"]],
                "exp_avg_sq": [torch.zeros(n) for n in case["sizes"]]}
        for s, rec in enumerate(a["steps"], start=1):
            w = F(1 - b1)
            small = abs(w) < F(0.5)
            coeff = w if small else F(w - F(1))
            b2f, c2, dec = F(b2), F(1 - b2), F(1 - lr * wd)
            ss, bc2s, ef = F(-(lr / (1 - b1 ** s))), F(math.sqrt(1 - b2 ** s)), F(eps)
            for t, n in enumerate(case["sizes"]):
                g = rec["grads"][t].float().numpy()
                p0, m0, v0 = (prev[k][t].numpy() for k in ("param", "exp_avg", "exp_avg_sq"))
                p1, m1, v1 = (rec[k][t].numpy() for k in ("param", "exp_avg", "exp_avg_sq"))
                for i in range(n):
                    region = "body" if i < n - n % 8 else "tail"
                    diff = F(g[i] - m0[i])
                    base = m0[i] if small else g[i]
                    mc = {"m=fma(coeff,g-m,m or g)": fma32(float(coeff), float(diff), float(base)),
                          "m=(m or g)+coeff*(g-m)": F(base + F(coeff * diff))}
                    tally.score(region, mc, f32_bits_of(float(m1[i])), always=True)
                    cg = F(c2 * g[i])
                    cgg = F(cg * g[i])
                    vb = F(v0[i] * b2f)
                    vc = {"v=(v*b2)+cgg": F(vb + cgg),
                          "v=fma(v,b2,cgg)": fma32(float(v0[i]), float(b2f), float(cgg)),
                          "v=fma(c2*g,g,v*b2)": fma32(float(cg), float(g[i]), float(vb))}
                    tally.score(region, vc, f32_bits_of(float(v1[i])))
                    # p from torch's own m and v, so only the p rounding is under test
                    den = F(F(np.sqrt(v1[i]) / bc2s) + ef)
                    upd = F(F(ss * m1[i]) / den)
                    if wd != 0:
                        pc = {"p=(p*decay)+upd": F(F(p0[i] * dec) + upd),
                              "p=fma(p,decay,upd)": fma32(float(p0[i]), float(dec), float(upd))}
                    else:
                        pc = {"p=p+upd": F(p0[i] + upd)}
                    tally.score(region, pc, f32_bits_of(float(p1[i])), always=True)
            prev = rec
        print(f"AdamW {case['name']}: matches / elements compared (v: only where the candidates differ)")
        tally.print(26)


# ---------------------------------------------------------------- evidence: Adagrad

def check_adagrad_amp():
    """torch's grad_scale / found_inf on fused Adagrad (asserted, printed as evidence): a
    power-of-two grad_scale 2^k gives the bits of the gradient times 2^-k (and torch writes
    the unscaled gradient back into p.grad); found_inf = 1 leaves param, sum and step."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(499)
    for n in (7, 8, 33, 1025):
        for k in (-3, 0, 10):
            p0 = torch.randn(n, generator=gen)
            g = torch.randn(n, generator=gen)
            runs = []
            for amp in (True, False):
                p = torch.nn.Parameter(p0.clone())
                opt = torch.optim.Adagrad([p], lr=1e-2, lr_decay=1e-2, weight_decay=0.1,
                                          initial_accumulator_value=0.1, fused=True)
                if amp:
                    opt.grad_scale = torch.tensor(2.0 ** k)
                    opt.found_inf = torch.tensor(0.0)
                for _ in range(2):
                    p.grad = g.clone() * (2.0 ** k) if amp else g.clone()
                    opt.step()
                    assert same_bits(p.grad, g), "grad_scale: unscaled gradient not stored"
                runs.append((p.detach().clone(), opt.state[p]["sum"].clone()))
            assert same_bits(runs[0][0], runs[1][0]) and same_bits(runs[0][1], runs[1][1]), \
                "grad_scale 2^k is not a read with scale 2^-k"
            p = torch.nn.Parameter(p0.clone())
            opt = torch.optim.Adagrad([p], lr=1e-2, fused=True)
            p.grad = g.clone()
            opt.grad_scale = torch.tensor(1.0)
            opt.found_inf = torch.tensor(1.0)
            opt.step()
            assert same_bits(p.detach(), p0) and opt.state[p]["step"].item() == 0.0
            assert bits_list(opt.state[p]["sum"]) == [0] * n
    print("checked: fused Adagrad grad_scale 2^k = gradient times 2^-k (unscaled gradient "
          "written back); found_inf = 1 writes nothing and leaves step")


def analyze_adagrad():
    """Per element, which rounding of the decayed gradient, of sum and of p reproduces
    torch, in the vector body (first numel - numel % 8 elements) and the scalar tail;
    and which binary64 denominator of clr (evidence for docs/numerics.md 8c)."""
    import numpy as np
    F = np.float32
    # plus one case not written to the file: 60 tensors that are all or mostly tail
    tail_heavy = adagrad_case("analysis_only_tail_heavy", [7] * 40 + [15] * 20, 408,
                              [1.0, 10.0, 0.1, 1.0, 1.0, 1.0], 1e-2, 0.01, 0.3, 0.1, 1e-10, True)
    for case in adagrad_cases() + [tail_heavy]:
        a = run_case(case, 1)
        hp = case["hp"]
        wd, ef, mx = F(hp["weight_decay"]), F(hp["eps"]), hp["maximize"]
        tally = CandidateTally()

        prev_p, prev_s = a["init"], a["init_state"]["sum"]
        for s, rec in enumerate(a["steps"], start=1):
            two, one = clr_candidates(hp["lr"], hp["lr_decay"], float(s))
            for t, n in enumerate(case["sizes"]):
                g0 = rec["grads"][t].numpy()
                p0, s0 = prev_p[t].numpy(), prev_s[t].numpy()
                p1, s1 = rec["param"][t].numpy(), rec["sum"][t].numpy()
                for i in range(n):
                    region = "body" if i < n - n % 8 else "tail"
                    g = F(-g0[i]) if mx else F(g0[i])
                    if hp["weight_decay"] != 0:
                        gs = {"g=g+p*wd": F(g + F(p0[i] * wd)),
                              "g=fma(p,wd,g)": F(fma32(float(p0[i]), float(wd), float(g)))}
                    else:
                        gs = {"g": g}
                    cands = {}
                    for gk, gv in gs.items():
                        cands[gk + " s=s+g*g"] = F(s0[i] + F(gv * gv))
                        cands[gk + " s=fma(g,g,s)"] = fma32(float(gv), float(gv), float(s0[i]))
                    tally.score(region, cands, f32_bits_of(float(s1[i])))
                    # p from torch's own sum, so only the update's rounding is under test
                    std = F(F(np.sqrt(s1[i])) + ef)
                    pc = {}
                    for gk, gv in gs.items():
                        for ck, c in (("clr twice", two), ("clr fma", one)):
                            pc[f"{gk} {ck} p=p-(clr*g)/std"] = F(p0[i] - F(F(F(c) * gv) / std))
                            pc[f"{gk} {ck} p=p-clr*(g/std)"] = F(p0[i] - F(F(c) * F(gv / std)))
                    tally.score(region, pc, f32_bits_of(float(p1[i])))
            prev_p, prev_s = rec["param"], rec["sum"]
        print(f"Adagrad {case['name']}: matches / elements compared (where the candidates differ)")
        tally.print(42)


# ---------------------------------------------------------------- evidence: Adam

def analyze_adam():
    """Per element, which candidate rounding reproduces torch's Adam/AdamW with L2 decay,
    amsgrad and maximize (the evidence behind docs/numerics.md 8a). The gradient candidates
    (L2 decay fused or not, in f32 or double, negation before or after it) are scored through
    the m and v they produce with the established lerp and v forms; p is checked from torch's
    own m, v and max, with the denominator from the new max or from v. Counted only where
    the candidates disagree, except p and max (always)."""
    import numpy as np
    F = np.float32
    for case in adam_cases():
        if case.get("nan_step"):
            continue
        a = run_case(case, 1)
        adam = case["opt"] == "adam"
        hp = case["hp"]
        lr, b1, b2, eps, wd = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"]
        ams, maxi = hp["amsgrad"], hp["maximize"]
        tally = CandidateTally()

        zeros = [torch.zeros(n) for n in case["sizes"]]
        prev = {"param": a["init"], "exp_avg": zeros, "exp_avg_sq": zeros, "max_exp_avg_sq": zeros}
        for s, rec in enumerate(a["steps"], start=1):
            w = F(1 - b1)
            small = abs(w) < F(0.5)
            coeff = w if small else F(w - F(1))
            b2f, c2, wd32, dec = F(b2), F(1 - b2), F(wd), F(1 - lr * wd)
            ss, bc2s, ef = F(-(lr / (1 - b1 ** s))), F(math.sqrt(1 - b2 ** s)), F(eps)
            for t, n in enumerate(case["sizes"]):
                g = rec["grads"][t].numpy()
                p0, m0, v0 = (prev[k][t].numpy() for k in ("param", "exp_avg", "exp_avg_sq"))
                x0 = prev["max_exp_avg_sq"][t].numpy() if ams else None
                p1, m1, v1 = (rec[k][t].numpy() for k in ("param", "exp_avg", "exp_avg_sq"))
                x1 = rec["max_exp_avg_sq"][t].numpy() if ams else None
                for i in range(n):
                    region = "body" if i < n - n % 8 else "tail"
                    gi = F(-g[i]) if maxi else g[i]
                    if adam and wd != 0:
                        gc = {"g=fma(p,f32(wd),g)": fma32(float(p0[i]), float(wd32), float(gi)),
                              "g=g+RN(p*f32(wd))": F(gi + F(p0[i] * wd32)),
                              "g=f32(g+p*wd) double": F(float(gi) + float(p0[i]) * wd)}
                        if maxi:
                            gc["g=-fma(p,f32(wd),g)"] = -fma32(float(p0[i]), float(wd32), float(g[i]))
                    elif maxi:
                        gc = {"g=-g": gi, "g=g (not negated)": g[i]}
                    else:
                        gc = {"g": gi}
                    mc, vc = {}, {}
                    for k, ge in gc.items():
                        ge = F(ge)
                        diff = F(ge - m0[i])
                        mc["m: " + k] = fma32(float(coeff), float(diff), float(m0[i] if small else ge))
                        cg, vb = F(c2 * ge), F(v0[i] * b2f)
                        vc["v: " + k] = (fma32(float(cg), float(ge), float(vb)) if region == "body"
                                         else fma32(float(v0[i]), float(b2f), float(F(cg * ge))))
                    tally.score(region, mc, f32_bits_of(float(m1[i])))
                    tally.score(region, vc, f32_bits_of(float(v1[i])))
                    dens = {"p: denominator from v": v1[i]}
                    if ams:
                        tally.score(region, {"max=max(old max, new v)": max(x0[i], v1[i])},
                                    f32_bits_of(float(x1[i])), always=True)
                        dens = {"p: denominator from new max": x1[i], **dens}
                    pc = {}
                    for k, r in dens.items():
                        den = F(F(np.sqrt(r) / bc2s) + ef)
                        upd = F(F(ss * m1[i]) / den)
                        base = F(p0[i] * dec) if (not adam and wd != 0) else p0[i]
                        pc[k] = F(base + upd)
                    tally.score(region, pc, f32_bits_of(float(p1[i])), always=True)
            prev = rec
        print(f"{case['opt']} {case['name']}: matches / elements compared "
              "(m, v: only where the candidates differ)")
        tally.print(32)


# ---------------------------------------------------------------- evidence: SignSGD

def check_sign_and_add():
    """Assertions about the torch operations SignSGD relies on (printed as evidence)."""
    for n in (1, 7, 8, 15, 16, 17, 33, 100):
        z = torch.sign(torch.full((n,), -0.0))
        assert all(b == 0 for b in bits_list(z)), "torch.sign(-0.0) is not +0"
        nan = torch.sign(torch.full((n,), float("nan")))
        assert all(b == 0 for b in bits_list(nan)), "torch.sign(NaN) is not +0"
    gen = torch.Generator().manual_seed(7)
    for lr, wd in ((5e-2, 0.5), (1e-3, 0.1)):
        c = f32_value(-lr * wd)
        vals = fma_discriminating_params(gen, 40, torch.tensor(c, dtype=torch.float32))
        for n in (1, 7, 13, 16, 17, 33, 40):     # scalar-only, body + tail, body only
            p = torch.tensor(vals[:n])
            p.add_(p, alpha=-lr * wd)
            want = [f32_bits_of(fma32(v, c, v)) for v in vals[:n]]
            assert bits_list(p) == want, f"add_ with alpha is not an FMA (n={n})"
    for n in (1, 7, 16, 33, 100):  # PlainSignSgd takes the sign of the widened gradient
        g = sign_sgd_grad(gen, n, torch.bfloat16)
        p = torch.randn(n, generator=gen)
        assert same_bits(p.clone().add_(torch.sign(g), alpha=-1e-2),
                         p.clone().add_(torch.sign(g.float()), alpha=-1e-2)), "bf16 sign"
    print("checked: torch.sign(+-0) = +0, torch.sign(NaN) = +0 (body and tail); "
          "p.add_(p, alpha=a) = fma(p, f32(a), p) on values where the FMA changes the result; "
          "p.add_(torch.sign(g), alpha) is the same for a bf16 g and its f32 widening")


# ---------------------------------------------------------------- evidence: SGD

def check_sgd_scale_and_found_inf():
    """torch's grad_scale / found_inf arguments of the fused SGD (printed as evidence):
    found_inf = 1 writes nothing (param, buffer, gradient), on a first and a later step;
    grad_scale divides the gradient and writes it back; for a power of two that equals
    stepcore's read with scale 1 / grad_scale, for 3.0 it does not here."""
    gen = torch.Generator().manual_seed(409)
    kw = dict(weight_decay=0.01, momentum=0.9, lr=0.1, dampening=0.0, nesterov=False, maximize=False)
    for first in (True, False):
        p, g = torch.randn(37, generator=gen), torch.randn(37, generator=gen)
        b = torch.randn(37, generator=gen)
        p0, g0, b0 = p.clone(), g.clone(), b.clone()
        torch._fused_sgd_([p], [g], [b], is_first_step=first, grad_scale=torch.tensor(4.0),
                          found_inf=torch.tensor(1.0), **kw)
        assert same_bits(p, p0) and same_bits(g, g0) and same_bits(b, b0), "found_inf wrote"
    equal = {}
    for scale in (8.0, 3.0):
        p, g = torch.randn(37, generator=gen), torch.randn(37, generator=gen)
        a, ga = p.clone(), g.clone()
        torch._fused_sgd_([a], [ga], [torch.empty_like(a)], is_first_step=True,
                          grad_scale=torch.tensor(scale), found_inf=torch.tensor(0.0), **kw)
        assert same_bits(ga, g / scale), "grad_scale: gradient not divided in place"
        b, gb = p.clone(), g * (1.0 / scale)
        torch._fused_sgd_([b], [gb], [torch.empty_like(b)], is_first_step=True, grad_scale=None,
                          found_inf=None, **kw)
        equal[scale] = same_bits(a, b)
    assert equal[8.0] and not equal[3.0], equal
    print("checked: fused SGD with found_inf = 1 writes nothing; grad_scale 8 equals the read "
          "scale 1/8, grad_scale 3 differs from the read scale 1/3")


SGD_FORMULA = {"decay": "fma(p,wd,g)", "buf_body": "fma(g,c,b*mom)", "buf_tail": "fma(b,mom,g*c)",
               "nesterov": "fma(b,mom,g)", "param": "fma(g,-lr,p)"}


def analyze_sgd():
    """Per element, which roundings of torch's four sums reproduce its buffer and parameter:
    every combination of candidates (each sum separately rounded or fused; for the buffer
    also the other product fused) is emulated from torch's own previous state, for the body
    (first numel - numel % W elements) and the tail, W = 8 and W = 16. Asserts that exactly
    SGD_FORMULA (docs/numerics.md 8b) with W = 8 matches every element."""
    import numpy as np
    F = np.float32

    def bits(x):
        return np.asarray(x, np.float32).view(np.uint32)

    def spec_terms(region):
        return {"none", "first:b=g", SGD_FORMULA["decay"], SGD_FORMULA["nesterov"],
                SGD_FORMULA["param"], SGD_FORMULA["buf_" + region]}

    w16_misses = 0
    for case in sgd_cases():
        a = run_case(case, 1)
        hp = case["hp"]
        wd, mom = F(hp["weight_decay"]), F(hp["momentum"])
        c, neg_lr = F(1 - hp["dampening"]), F(-hp["lr"])
        tally = {}
        prev_p = [x.numpy() for x in a["init"]]
        prev_b = None
        for s, rec in enumerate(a["steps"]):
            for t, n in enumerate(case["sizes"]):
                g = rec["grads"][t].numpy()
                if hp["maximize"]:
                    g = -g
                p0, p1 = prev_p[t], rec["param"][t].numpy()
                decays = {"none": g}
                if hp["weight_decay"] != 0:
                    decays = {"fma(p,wd,g)": fma32_array(p0, wd, g), "g+RN(p*wd)": g + p0 * wd}
                for dk, g1 in decays.items():
                    bufs = {"none": None}
                    if hp["momentum"] != 0 and s == 0:
                        bufs = {"first:b=g": g1}
                    elif hp["momentum"] != 0:
                        b0 = prev_b[t]
                        bufs = {"fma(g,c,b*mom)": fma32_array(g1, c, b0 * mom),
                                "fma(b,mom,g*c)": fma32_array(b0, mom, g1 * c),
                                "RN(b*mom)+RN(g*c)": b0 * mom + g1 * c}
                    for bk, b1 in bufs.items():
                        if b1 is None:
                            nests = {"none": g1}
                        elif hp["nesterov"]:
                            nests = {"fma(b,mom,g)": fma32_array(b1, mom, g1), "g+RN(b*mom)": g1 + b1 * mom}
                        else:
                            nests = {"none": b1}
                        for nk, g2 in nests.items():
                            for pk, pn in (("fma(g,-lr,p)", fma32_array(g2, neg_lr, p0)),
                                           ("p+RN(g*-lr)", p0 + g2 * neg_lr)):
                                ok = bits(pn) == bits(p1)
                                if b1 is not None:
                                    ok &= bits(b1) == bits(rec["momentum_buffer"][t].numpy())
                                for width in (8, 16):
                                    tail = np.arange(n) >= n - n % width
                                    for region, mask in (("body", ~tail), ("tail", tail)):
                                        key = (width, region, dk, bk, nk, pk)
                                        tot, hit = tally.get(key, (0, 0))
                                        tally[key] = (tot + int(mask.sum()), hit + int(ok[mask].sum()))
            prev_p = [x.numpy() for x in rec["param"]]
            prev_b = [x.numpy() for x in rec.get("momentum_buffer", [])]
        print(f"SGD {case['name']}: combinations that match every element (W=8 | W=16), "
              "and the best of the rest")
        for width in (8, 16):
            for region in ("body", "tail"):
                rows = sorted(((hit / tot if tot else 1.0, k, tot, hit)
                               for k, (tot, hit) in tally.items() if k[:2] == (width, region)),
                              key=lambda r: -r[0])
                full = [r for r in rows if r[3] == r[2]]
                rest = [r for r in rows if r[3] != r[2]]
                for _, k, tot, hit in full + rest[:1]:
                    print(f"  W={width:2d} {region:4s} {' '.join(k[2:]):60s} {hit:6d} / {tot}")
                spec = [r for r in rows if all(x in spec_terms(region) for x in r[1][2:])]
                if width == 8:
                    assert spec and spec[0][3] == spec[0][2], \
                        f"{case['name']} {region}: the spec formula does not match torch"
                else:
                    w16_misses += sum(tot - hit for _, _, tot, hit in spec)
    assert w16_misses > 0, "W = 16 is not rejected by the data"
    print(f"SGD: the spec formula with W = 8 matches every element of every case; with W = 16 "
          f"it misses {w16_misses} element-steps")


# ---------------------------------------------------------------- evidence: bf16 / f16 params

def check_lowp_grad_scale():
    """torch's grad_scale on bf16/f16 params divides the widened gradient in f32 and uses
    the quotient unrounded (it stores the rounded one into p.grad): asserted on SGD with
    nesterov, where the unrounded quotient reaches the parameter through two FMAs. A
    stepcore read with scale 2^-k rounds the product to the gradient's dtype (section 3),
    so it differs where quotients fall below that dtype's normal range (f16 with the
    default GradScaler scale 2^16 and gradients below 4); an f32 gradient (the exact
    widening) read with scale 2^-k gives torch's bits. Printed as evidence."""
    torch.set_num_threads(1)
    for dt, gs, mag in ((torch.float16, 65536.0, 1.0), (torch.bfloat16, 2.0 ** 20, 2.0 ** -110)):
        n = 1029
        g = (torch.randn(n, generator=torch.Generator().manual_seed(611)) * mag).to(dt)
        res = {}
        for mode in ("scale", "rounded"):
            p = torch.nn.Parameter(torch.zeros(n, dtype=dt))
            opt = torch.optim.SGD([p], lr=1.0, momentum=0.9, nesterov=True, fused=True)
            if mode == "scale":
                p.grad = g.clone()
                opt.grad_scale = torch.tensor(gs)
                opt.found_inf = torch.tensor(0.0)
            else:
                p.grad = (g.float() / gs).to(dt)
            opt.step()
            res[mode] = p.detach().clone()
        q = g.float() / gs                         # exact: a power of two
        want = []
        for x in q.tolist():
            b = x                                  # first step: b = g
            gg = fma32(b, f32_value(0.9), x)       # nesterov: fma(b, mom, g)
            want.append(fma32(gg, -1.0, 0.0))      # fma(g, -lr, p)
        want = torch.tensor(want, dtype=torch.float32).to(dt)
        assert same_bits(res["scale"], want), f"{dt}: grad_scale is not an unrounded f32 quotient"
        differ = int((res["scale"].view(torch.int16) != res["rounded"].view(torch.int16)).sum())
        assert differ > 0
        print(f"checked: {dt} grad_scale {gs:g} is the unrounded f32 quotient; a gradient "
              f"rounded to {dt} first differs in {differ} of {n} params")


def analyze_lowp():
    """Per element, which reading of torch's reduced-precision kernels reproduces its bf16 and
    f16 results (docs/numerics.md 7.3): the f32 formula of each optimizer with its f32
    scalars, values widened when loaded and rounded when stored, the tail the last
    numel mod 16 elements ("spec"), against the same with the 8-element f32 tail or no tail,
    with m/v/b/sum rounded to T before use ("rounded"), and with the body's scalars rounded
    to T first as older copies of torch's source write them ("T scalars"). Each step starts
    from torch's own state; counts are mismatching param + state words. Asserts "spec" has
    none."""
    import numpy as np
    F = np.float32

    def f32a(t):
        return t.detach().float().numpy().copy()

    def rnd(x, dt):
        return torch.from_numpy(np.asarray(x, np.float32).copy()).to(dt).float().numpy()

    def sc(x, dt, lp):
        return F(torch.tensor(float(x)).to(dt).float().item()) if lp else F(x)

    def bits(x):
        return np.asarray(x, np.float32).view(np.uint32)

    def emulate(opt, hp, st, g, step, dt, W, rounded, lp_scalars):
        n = g.size
        tail = np.zeros(n, bool)
        if W > 1:
            tail[n - n % W:] = True
        out = {}
        for region in ("body", "tail"):
            lp = lp_scalars and region == "body"
            p = st["param"].copy()
            gg = -g if hp.get("maximize") else g.copy()
            res = {}
            if opt in ("adam", "adamw"):
                b1, b2 = hp["beta1"], hp["beta2"]
                lr, wd, eps = hp["lr"], hp["weight_decay"], hp["eps"]
                w = F(1 - b1)
                small = abs(w) < F(0.5)
                coeff = w if small else F(w - F(1))
                if wd != 0:
                    if opt == "adam":
                        gg = fma32_array(p, sc(wd, dt, lp), gg)
                    else:
                        p = (p * sc(1 - lr * wd, dt, lp)).astype(F)
                m0, v0 = st["exp_avg"], st["exp_avg_sq"]
                m = fma32_array(coeff, (gg - m0).astype(F), m0 if small else gg)
                cg = (F(1 - b2) * gg).astype(F)
                if region == "body":
                    v = fma32_array(cg, gg, (v0 * F(b2)).astype(F))
                else:
                    v = fma32_array(v0, F(b2), (cg * gg).astype(F))
                if rounded:
                    m, v = rnd(m, dt), rnd(v, dt)
                r = v
                if hp.get("amsgrad"):
                    x0 = st["max_exp_avg_sq"]
                    if region == "body":
                        r = np.where(np.isnan(x0) | np.isnan(v), np.nan,
                                     np.where(x0 > v, x0, v)).astype(F)
                    else:
                        r = np.where(x0 < v, v, x0).astype(F)
                    res["max_exp_avg_sq"] = r
                bc2s = F(math.sqrt(1 - b2 ** step))
                d = ((np.sqrt(r) / bc2s).astype(F) + sc(eps, dt, lp)).astype(F)
                ns = sc(-(lr / (1 - b1 ** step)), dt, lp)
                p = (p + ((ns * m).astype(F) / d).astype(F)).astype(F)
                res.update(exp_avg=m, exp_avg_sq=v)
            elif opt == "sgd":
                mom, wd = hp["momentum"], hp["weight_decay"]
                if wd != 0:
                    gg = fma32_array(p, sc(wd, dt, lp), gg)
                if mom != 0:
                    b0 = st["momentum_buffer"]
                    c = sc(1 - hp["dampening"], dt, lp)
                    m32 = sc(mom, dt, lp)
                    if step == 1:
                        b = gg
                    elif region == "body":
                        b = fma32_array(gg, c, (b0 * m32).astype(F))
                    else:
                        b = fma32_array(b0, m32, (gg * c).astype(F))
                    if rounded:
                        b = rnd(b, dt)
                    res["momentum_buffer"] = b
                    gg = fma32_array(b, m32, gg) if hp.get("nesterov") else b
                p = fma32_array(gg, F(-hp["lr"]), p)
            else:  # adagrad
                wd = hp["weight_decay"]
                if wd != 0:
                    gg = fma32_array(p, sc(wd, dt, lp), gg)
                sm = fma32_array(gg, gg, st["sum"])
                if rounded:
                    sm = rnd(sm, dt)
                clr = hp["lr"] / double_fma(step - 1.0, hp["lr_decay"], 1.0)
                d = (np.sqrt(sm) + sc(hp["eps"], dt, lp)).astype(F)
                p = (p - ((sc(clr, dt, lp) * gg).astype(F) / d).astype(F)).astype(F)
                res["sum"] = sm
            res["param"] = p
            out[region] = res
        return {k: rnd(np.where(tail, out["tail"][k], out["body"][k]), dt) for k in out["body"]}

    cands = {"spec": (16, False, False), "8-element tail": (8, False, False),
             "no tail": (1, False, False), "rounded": (16, True, False),
             "T scalars": (16, False, True)}
    cases = [("adam", dict(lr=1e-2, beta1=0.3, beta2=0.6, eps=1e-8, weight_decay=0.1,
                           amsgrad=True)),
             ("adamw", dict(lr=1e-2, beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.1,
                            maximize=True)),
             ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.05)),
             ("sgd", dict(lr=3e-2, momentum=0.9, dampening=0.0, weight_decay=0.1, nesterov=True,
                          maximize=True)),
             ("adagrad", dict(lr=5e-2, lr_decay=1e-2, weight_decay=1e-2,
                              initial_accumulator_value=0.1, eps=1e-6, maximize=True))]
    sizes = [15] * 150 + [31] * 50 + [100, 1025]
    for opt, hp in cases:
        for dt in (torch.bfloat16, torch.float16):
            torch.set_num_threads(1)
            gen = torch.Generator().manual_seed(620)
            params = [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.5).to(dt))
                      for n in sizes]
            o = make_optimizer(opt, params, hp)
            keys = used_slots(opt, hparams(opt, hp))
            state = [{"param": f32a(p), **{k: np.zeros(p.numel(), F) for k in keys}}
                     for p in params]
            if opt == "adagrad":
                for t, p in enumerate(params):
                    state[t]["sum"] = f32a(o.state[p]["sum"])
            tally = {c: 0 for c in cands}
            for step in range(1, 6):
                grads = [(torch.randn(n, generator=gen) *
                          10.0 ** torch.randint(-3, 2, (n,), generator=gen).float()).to(dt)
                         for n in sizes]
                for p, g in zip(params, grads):
                    p.grad = g
                o.step()
                for t, (p, g) in enumerate(zip(params, grads)):
                    got = {"param": f32a(p), **{k: f32a(o.state[p][k]) for k in keys}}
                    for c, (W, rounded, lp) in cands.items():
                        e = emulate(opt, hp, state[t], f32a(g), step, dt, W, rounded, lp)
                        tally[c] += sum(int((bits(e[k]) != bits(got[k])).sum()) for k in got)
                    state[t] = got
            print(f"lowp {opt} {str(dt)[6:]} {hp}: mismatching words " +
                  ", ".join(f"{c} {v}" for c, v in tally.items()))
            assert tally["spec"] == 0, f"{opt} {dt}: the 7.3 definition disagrees with torch"


# ---------------------------------------------------------------- clip_grad_norm_

def clip_cases():
    cases = [
        dict(name="max_norm_below_norm", sizes=[7, 0, 100], scales=[1.0, 1.0, 1.0], max_norm=1.0),
        dict(name="max_norm_above_norm", sizes=[7, 0, 100], scales=[1.0, 1.0, 1.0], max_norm=100.0),
        dict(name="tiny_1e-8", sizes=[33, 13], scales=[1e-8, 1e-8], max_norm=1e-9),
        dict(name="large_1e3", sizes=[257, 1025], scales=[1e3, 1e3], max_norm=5.0),
        dict(name="mixed_magnitudes", sizes=[13, 31, 0, 16, 8], scales=[1e-8, 1e3, 1.0, 1.0, 1e-3],
             max_norm=0.5),
        dict(name="single_element", sizes=[1], scales=[3.0], max_norm=2.0),
        dict(name="zeros", sizes=[5, 0, 3], scales=[0.0, 0.0, 0.0], max_norm=1.0),
        dict(name="with_subnormals", sizes=[17, 9], scales=[1e-3, 1e-41], max_norm=1e-4),
        dict(name="max_norm_equal_norm", sizes=[31], scales=[1.0], max_norm=None),
        # torch squares in f32: these underflow or overflow there (its norm is 0, inexact
        # or +Inf), the exact norm does not; no bound between the two is claimed
        dict(name="subnormal_only", sizes=[9, 4], scales=[None, None], max_norm=1.0, check="none"),
        dict(name="tiny_1e-30", sizes=[20], scales=[1e-30], max_norm=1e-31, check="none"),
        dict(name="tiny_1e-20", sizes=[37], scales=[1e-20], max_norm=1e-21, check="none"),
        dict(name="huge_1e19", sizes=[37], scales=[1e19], max_norm=1.0, check="none"),
    ]
    rng = torch.Generator().manual_seed(399)
    for i in range(24):
        k = int(torch.randint(1, 6, (1,), generator=rng))
        sizes = [int(torch.randint(0, 80, (1,), generator=rng)) for _ in range(k)]
        if sum(sizes) == 0:
            sizes[0] = 5
        scales = [10.0 ** float(torch.empty(1).uniform_(-3, 3, generator=rng)) for _ in range(k)]
        mn = 10.0 ** float(torch.empty(1).uniform_(-3, 1, generator=rng))
        cases.append(dict(name=f"random_{i:02d}", sizes=sizes, scales=scales, max_norm=mn,
                          relative=True))
    return cases


def write_clip(path, header):
    torch.set_num_threads(1)
    lines = list(header)
    lines += ["# torch.nn.utils.clip_grad_norm_(params, max_norm), f32 gradients."]
    gen = torch.Generator().manual_seed(301)
    disagree = 0
    for case in clip_cases():
        grads = []
        for n, sc in zip(case["sizes"], case["scales"]):
            if sc is None:  # random subnormals of both signs
                b = torch.randint(1, 1 << 23, (n,), generator=gen) | (torch.randint(0, 2, (n,), generator=gen) << 31)
                grads.append(b.to(torch.int32).view(torch.float32))
            else:
                grads.append(torch.randn(n, generator=gen) * sc)
        if case["name"] == "with_subnormals":
            grads[1][0] = -1e-45
        if case["sizes"][0] >= 3:
            grads[0][1] = -0.0
        params = [torch.nn.Parameter(torch.zeros(n)) for n in case["sizes"]]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        exact = exact_norm_bits(grads)
        mn = case["max_norm"]
        if mn is None:                   # the exact f32 norm itself
            mn = torch.tensor([exact], dtype=torch.int64).to(torch.int32).view(torch.float32).item()
        elif case.get("relative"):       # scale max_norm to the norm: mostly below, some above
            norm = torch.tensor([exact], dtype=torch.int64).to(torch.int32).view(torch.float32).item()
            mn = mn * norm * 3.0
        total = torch.nn.utils.clip_grad_norm_(params, mn)
        assert total.dtype == torch.float32 and total.dim() == 0
        # torch's coefficient, by the expression clip_grad_norm_ evaluates
        coef = torch.clamp(mn / (total + 1e-6), max=1.0)
        for p, g in zip(params, grads):
            assert same_bits(p.grad, g * coef), f"{case['name']}: coefficient does not reproduce torch"
        # the coefficient as a single f32 division would give it (the doc's first reading)
        d = total + torch.tensor(1e-6, dtype=torch.float32)
        q = torch.tensor(mn, dtype=torch.float32) / d
        div = torch.where(q < 1, q, torch.ones_like(q))
        if not same_bits(div.reshape(1), coef.reshape(1)):
            disagree += 1
        lines.append(f"# max_norm={mn!r} coef_by_division={'same' if same_bits(div.reshape(1), coef.reshape(1)) else f32_words(div.reshape(1))}")
        check = case.get("check", "bound")
        if check == "bound":  # the bound tests/test_golden.cpp applies (see the README)
            e = torch.tensor([exact], dtype=torch.int64).to(torch.int32).view(torch.float32).item()
            N, K = sum(case["sizes"]), len(case["sizes"])
            assert abs(total.item() - e) <= (N + K + 4) * 2.0 ** -24 * e, case["name"]
        lines.append(line("case", case["name"], len(grads), check))
        lines.append(line("max_norm", float(mn).hex(), "%08x" % f32_bits_of(mn)))
        lines.append(line("sizes", *case["sizes"]))
        for t, g in enumerate(grads):
            lines.append(tensor_line("grad", t, g))
        lines.append(line("norm_torch", f32_words(total.reshape(1))))
        lines.append(line("norm_exact", "%08x" % exact))
        lines.append(line("coef_torch", f32_words(coef.reshape(1))))
        for t, p in enumerate(params):
            lines.append(tensor_line("clipped", t, p.grad))
        lines.append("end")
    write(path, lines)
    print(f"clip: {disagree} of {len(clip_cases())} cases have RN(max_norm / denom) != torch's "
          "RN(RN(1/denom) * max_norm)")


# ---------------------------------------------------------------- main

def write(path, lines):
    with open(path, "w", encoding="ascii", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def self_test():
    # exact norm: small hand-checked values
    one = f32_bits_of(1.0)
    assert rn_f32_sqrt_units(f32_units(one) ** 2) == one
    assert rn_f32_sqrt_units(2 * f32_units(one) ** 2) == f32_bits_of(math.sqrt(2.0))
    assert rn_f32_sqrt_units(1) == 1                       # sqrt(2^-298) = 2^-149
    assert rn_f32_sqrt_units(25 * f32_units(one) ** 2) == f32_bits_of(5.0)
    assert fma32(1.0, 1.0, -1.0) == 0.0 and math.copysign(1, fma32(-0.0, 1.0, -0.0)) < 0


# Per --only name: the checks of torch's behaviour run before its file is written, and
# the analysers --analyze runs after.
CHECKS = {"sgd": [check_sgd_scale_and_found_inf], "adagrad": [check_adagrad_amp],
          "lowp": [check_lowp_grad_scale]}
ANALYSERS = {"adamw": [analyze_adamw], "adam": [analyze_adam], "sgd": [analyze_sgd],
             "adagrad": [analyze_adagrad], "lowp": [analyze_lowp]}


def main():
    names = list(FILES) + ["clip"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/data", help="output directory (default tests/data)")
    ap.add_argument("--analyze", action="store_true", help="print the per-element formula analysis")
    ap.add_argument("--any-capability", action="store_true",
                    help="allow a CPU capability other than AVX2 (files will differ)")
    ap.add_argument("--only", default=",".join(names),
                    help=f"comma-separated files to write: {', '.join(names)} (default all)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    unknown = only - set(names)
    if unknown:
        sys.exit(f"unknown --only entries: {sorted(unknown)}")
    cap = torch.backends.cpu.get_cpu_capability()
    if cap != "AVX2" and not args.any_capability:
        sys.exit(f"torch reports CPU capability {cap}; the checked-in files are from AVX2")
    self_test()
    check_sign_and_add()
    header = [f"# Generated by tools/golden/make_golden.py: torch {torch.__version__}, "
              f"CPU capability {cap}, python {sys.version.split()[0]}. Do not edit.",
              "# Format: tests/data/README.md."]
    os.makedirs(args.out, exist_ok=True)
    for name in names:
        if name not in only:
            continue
        if name == "clip":
            write_clip(os.path.join(args.out, "clip_grad_norm.txt"), header)
            continue
        for check in CHECKS.get(name, []):
            check()
        path, title, cases = FILES[name]
        if name.endswith("torchao"):
            import torchao
            title = title + [f"# torchao {torchao.__version__}."]
        write_optimizer_file(os.path.join(args.out, path), header, title, cases())
        if args.analyze:
            for analyse in ANALYSERS.get(name, []):
                analyse()


if __name__ == "__main__":
    main()
