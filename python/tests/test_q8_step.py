"""Engine.step with 8-bit state slots ((codes, absmax) pairs, docs/numerics.md 8f): equal to
reference_step bit for bit on every ISA, refused with the slot named when malformed, and
with formula="torchao" equal to torchao.optim.AdamW8bit's and Adam8bit's compiled CPU steps on quantized
tensors (at least 4,096 elements, a multiple of its 256-element block)."""

import numpy as np
import pytest

import stepcore

BLOCK = 256


def q8_slot(n, rng=None, non_negative=False):
    """A (codes, absmax) pair for n elements: random codes and maxima, or zeros."""
    blocks = (n + BLOCK - 1) // BLOCK
    if rng is None:
        return np.zeros(n, np.uint8), np.zeros(blocks, np.float32)
    codes = rng.integers(0, 256, n, dtype=np.uint8)
    absmax = (rng.random(blocks, dtype=np.float32) * (1e-6 if non_negative else 1e-3))
    absmax[::3] = 0.0  # some all-zero blocks
    return codes, absmax.astype(np.float32)


def case(sizes, slots, seed):
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(n, dtype=np.float32) for n in sizes]
    grads = [(rng.standard_normal(n, dtype=np.float32) * 1e-2) for n in sizes]
    for g in grads:
        g[::7] = 0.0
    states = [[q8_slot(n, rng, k > 0) for n in sizes] for k in range(slots)]
    steps = [np.zeros((), np.float32) for _ in sizes]
    return params, states, steps, grads


def copy(c):
    params, states, steps, grads = c
    return ([p.copy() for p in params],
            [[(a.copy(), b.copy()) for a, b in slot] for slot in states],
            [s.copy() for s in steps], grads)


def same_bits(a, b, what):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), what


@pytest.mark.parametrize("optimizer,hyper", [
    ("adamw", {}),
    ("adamw", {"formula": "native"}),
    ("adamw", {"formula": "torchao", "amsgrad": True, "weight_decay": 0.1}),
    ("adam", {"weight_decay": 0.05}),
    ("adam", {"formula": "torchao", "amsgrad": True, "weight_decay": 0.05}),
])
def test_engine_equals_the_reference_on_every_isa(optimizer, hyper):
    sizes = [0, 1, 255, 256, 257, 4097, 70001]
    slots = len(stepcore.optimizer_slots(optimizer, hyper))
    start = case(sizes, slots, 5)
    want = copy(start)
    for isa in stepcore.supported_isas():
        for threads in (1, 3):
            got = copy(start)
            engine = stepcore.Engine(isa=isa, threads=threads)
            for step in range(3):
                if isa == stepcore.supported_isas()[0] and threads == 1:
                    stepcore.reference_step(optimizer, want[0], want[1], want[2], want[3],
                                            hyper=hyper, grad_scale=0.5)
                engine.step(optimizer, got[0], got[1], got[2], got[3], hyper=hyper,
                            grad_scale=0.5)
            for i, n in enumerate(sizes):
                same_bits(got[0][i], want[0][i], f"{isa} t{threads} param {i} (n {n})")
                for k in range(slots):
                    for part in (0, 1):
                        same_bits(got[1][k][i][part], want[1][k][i][part],
                                  f"{isa} t{threads} slot {k} part {part} of {i}")


def test_malformed_slots_are_refused_naming_them():
    engine = stepcore.Engine()
    params, states, steps, grads = case([300], 2, 1)
    before = copy((params, states, steps, grads))
    bad = [
        [[(states[0][0][0],)], states[1]],  # not a pair
        [[(states[0][0][0][:299], states[0][0][1])], states[1]],  # one code short
        [[(states[0][0][0].astype(np.int8), states[0][0][1])], states[1]],  # not uint8
        [[states[0][0]], [np.zeros(300, np.float32)]],  # 8-bit and f32 slots mixed
    ]
    for st in bad:
        with pytest.raises((ValueError, TypeError)) as e:
            engine.step("adamw", params, st, steps, grads)
        assert "states[" in str(e.value), str(e.value)
    with pytest.raises(TypeError) as e:
        engine.step("lion", params, [states[0]], None, grads)
    assert "states[0][0]" in str(e.value)
    same_bits(params[0], before[0][0], "param written")
    same_bits(states[0][0][0], before[1][0][0][0], "codes written")


@pytest.mark.parametrize("optimizer,cls,wd", [
    ("adamw", "AdamW8bit", 0.1), ("adam", "Adam8bit", 0.05), ("adam", "Adam8bit", 0.0)])
def test_torchao_formula_equals_torchaos_on_quantized_tensors(optimizer, cls, wd):
    """Ten steps from torchao's initial state (codes 0, maxima 0), gradients from 1e-3 to
    1e6, every eleventh zero, params with -0, +0 and +-Inf: params, codes and maxima bit for
    bit after each step (Adam: the L2 term g + wd*p, even for wd 0, where an infinite p's
    0*Inf is NaN). (torchao 0.18 cannot step amsgrad with 8-bit state: torch.compile finds
    no torch.maximum for its state subclass.)"""
    torch = pytest.importorskip("torch")
    optim = pytest.importorskip("torchao.optim")
    gen = torch.Generator().manual_seed(42)
    for n in (4096, 4096 * 2 + 512):
        amsgrad = False
        init = torch.randn(n, generator=gen) * 0.5
        init[1], init[2] = -0.0, 0.0
        init[n - 1], init[n - 2] = float("inf"), -float("inf")  # the last block's state: NaN
        theirs = torch.nn.Parameter(init.clone())
        b = getattr(optim, cls)([theirs], lr=3e-3, betas=(0.9, 0.99), weight_decay=wd,
                                amsgrad=amsgrad)
        p = init.clone().numpy()
        names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        states = [[q8_slot(n)] for _ in names]  # torchao's zeros: codes 0, maxima 0
        step = np.zeros((), np.float32)
        engine = stepcore.Engine()
        hyper = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": wd,
                 "amsgrad": amsgrad, "formula": "torchao"}
        for s in range(10):
            g = torch.randn(n, generator=gen) * 10.0 ** (s - 3)
            g[::11] = 0.0
            theirs.grad = g.clone()
            b.step()
            engine.step(optimizer, [p], states, [step], [g.numpy().copy()], hyper=hyper)
            same_bits(p, theirs.detach().numpy(), f"param, step {s}, amsgrad {amsgrad}")
            for k, name in enumerate(names):
                st = b.state[theirs][name]
                same_bits(states[k][0][0], st.codes.numpy(), f"{name} codes, step {s}")
                same_bits(states[k][0][1], st.scale.numpy(), f"{name} scale, step {s}")
