"""Tests of stepcore.torch.Lion against an independent transliteration of docs/numerics.md 8d
written here in single torch/numpy f32 operations (torch has no Lion to compare with).

Every ISA, tensor sizes 0, 1, 7-9, 31-33, 1023-1025 and one ~10^6 case, 10 steps with two
param groups and a LambdaLR schedule, AMP grad_scale/found_inf: params and exp_avg equal the
transliteration bit for bit after every step, in f32, bf16 and f16. Also: the sign's edges (zeros, NaN), the
state_dict round trip, bad hyper-parameters named before anything is written, and Lion
through GradientManager-free Engine.step by name.
"""

import copy
import math

import pytest

torch = pytest.importorskip("torch", reason="stepcore.torch tests need PyTorch")
np = pytest.importorskip("numpy", reason="stepcore.torch tests need numpy")

import stepcore  # noqa: E402
import stepcore.torch as st  # noqa: E402
from test_torch_adamw import BIG, ISAS, assert_bits, fma_f32, make_grad, schedule  # noqa: E402

SIZES = [0, 1, 7, 8, 9, 31, 32, 33, 1023, 1024, 1025]
AMP = {2: (65536.0, 0.0), 4: (3.0, 0.0), 6: (1024.0, 1.0), 8: (0.75, 0.0)}
OPTIONS = [dict(), dict(weight_decay=0.1), dict(betas=(0.95, 0.98), weight_decay=0.01),
           dict(betas=(0.0, 1.0)), dict(betas=(0.3, 0.2), weight_decay=1.0)]


def lion_expected(p, g, m, lr, beta1, beta2, wd):
    """docs/numerics.md 8d, element by element in f32: returns the new (p, m)."""
    f32 = np.float32
    p = p.numpy().astype(f32)
    g = g.float().numpy().astype(f32)
    m = m.numpy().astype(f32)
    b1, c1 = f32(beta1), f32(1.0 - beta1)
    b2, c2 = f32(beta2), f32(1.0 - beta2)
    with np.errstate(invalid="ignore", over="ignore"):
        u = (b1 * m) + (c1 * g)  # numpy f32: each operator one rounding
        s = np.where(u > 0, f32(1), np.where(u < 0, f32(-1), np.where(np.isnan(u), u, f32(0))))
        s = s.astype(f32)
        if wd > 0:
            p = fma_f32(p, f32(-(lr * wd)), p)
        p = (p + (s * f32(-lr))).astype(f32)
        m_new = ((b2 * m) + (c2 * g)).astype(f32)
    return torch.from_numpy(p.copy()), torch.from_numpy(m_new.copy())


def lion_expected_in(dtype, p, g, m, *args):
    """lion_expected on params and state stored in `dtype`: loaded exactly, math in f32,
    each store rounded to nearest even (docs/numerics.md 7.3; torch's .to rounds so)."""
    p_new, m_new = lion_expected(p.float(), g, m.float(), *args)
    return p_new.to(dtype), m_new.to(dtype)


def assert_same(a, b, what):
    """assert_bits; an f16 NaN compared as NaN-ness (stepcore stores every f16 NaN as
    0x7E00, torch's conversion keeps the sign: docs/numerics.md 2)."""
    if a.dtype == torch.float16:
        na, nb = torch.isnan(a.detach()), torch.isnan(b.detach())
        assert torch.equal(na, nb), f"{what}: NaN at different elements"
        a, b = a.detach().masked_fill(na, 0.0), b.detach().masked_fill(nb, 0.0)
    assert_bits(a, b, what)


def run_against_transliteration(opts, sizes, isa, steps=10, amp=AMP, seed=0, threads=0,
                                dtype=torch.float32):
    """Steps stepcore.torch.Lion (two groups, a LambdaLR) and the transliteration side by
    side; checks params, exp_avg and the unscaled grads after every step. Params, grads and
    state in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    want_p = [x.clone() for x in init]
    want_m = [torch.zeros(n, dtype=dtype) for n in sizes]
    half = len(sizes) // 2
    lr = 3e-3
    wd = opts.get("weight_decay", 0.0)
    betas = opts.get("betas", (0.9, 0.99))
    groups = [dict(params=ours[:half]), dict(params=ours[half:], lr=lr / 3, weight_decay=wd / 2)]
    opt = st.Lion(groups, lr=lr, isa=isa, threads=threads, **opts)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    group_of = [0] * half + [1] * (len(sizes) - half)
    base = [(lr, wd), (lr / 3, wd / 2)]
    for step in range(steps):
        grads = [make_grad(n, gen).to(dtype) for n in sizes]
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        scale, found = amp.get(step, (None, None))
        if scale is None:
            opt.step()
        else:
            opt.step(grad_scale=torch.tensor(scale), found_inf=torch.tensor(found))
        if found != 1.0:
            mult = schedule(step)
            for i, g in enumerate(grads):
                glr, gwd = base[group_of[i]]
                read = g if scale is None else torch.div(g.float(), torch.tensor(scale))
                want_p[i], want_m[i] = lion_expected_in(dtype, want_p[i], read, want_m[i],
                                                        glr * mult, betas[0], betas[1], gwd)
                if scale is not None:  # the quotient, stored back in the grad's dtype
                    assert_same(ours[i].grad, read.to(dtype), f"step {step} grad {i}")
        for i in range(len(sizes)):
            where = f"step {step} tensor {i} (n={sizes[i]})"
            assert_same(ours[i].detach(), want_p[i], where + " param")
            if sizes[i] and (found != 1.0 or opt.state.get(ours[i])):
                assert_same(opt.state[ours[i]]["exp_avg"], want_m[i], where + " exp_avg")
        sched.step()
    return opt, ours


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
                         or "defaults")
def test_lion_equals_its_transliteration(opts, isa):
    run_against_transliteration(opts, SIZES, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("opts", OPTIONS[:3], ids=["defaults", "wd", "betas-wd"])
def test_lion_16bit_params_keep_their_state_in_their_dtype(opts, dtype, isa):
    run_against_transliteration(opts, SIZES, isa, dtype=dtype)


@pytest.mark.parametrize("threads", [1, 3])
def test_lion_large_tensor_and_threads(threads):
    run_against_transliteration(dict(weight_decay=0.1), [BIG, 5], None, steps=3,
                                amp={1: (3.0, 0.0)}, threads=threads)


def test_lion_state_layout_and_sign_edges():
    # u = (+-0): p keeps its bits; a NaN gradient makes p NaN; no step counter in the state.
    p = torch.nn.Parameter(torch.tensor([1.5, -0.0, 0.0, 2.0, 1.0, 1.0]))
    opt = st.Lion([p], lr=0.125)
    p.grad = torch.tensor([0.0, -0.0, 0.0, -0.0, math.nan, math.inf])
    opt.step()
    assert list(opt.state[p].keys()) == ["exp_avg"]
    got = p.detach()
    assert_bits(got[:4], torch.tensor([1.5, -0.0, 0.0, 2.0]), "zero update keeps p")
    assert math.isnan(got[4].item())
    assert got[5].item() == 0.875


def test_lion_state_dict_round_trip():
    gen = torch.Generator().manual_seed(3)
    sizes = [7, 33, 1025]
    a = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    oa = st.Lion(a, lr=1e-2, weight_decay=0.1)
    grads = [[make_grad(n, gen) for n in sizes] for _ in range(6)]
    for k in range(3):
        for p, g in zip(a, grads[k]):
            p.grad = g.clone()
        oa.step()
    saved = copy.deepcopy(oa.state_dict())  # torch's state_dict shares the state tensors
    ob = st.Lion(b, lr=1.0)  # the loaded groups replace these hyper-parameters
    with torch.no_grad():
        for x, y in zip(a, b):
            y.copy_(x)
    ob.load_state_dict(saved)
    for k in range(3, 6):
        for ps, opt in ((a, oa), (b, ob)):
            for p, g in zip(ps, grads[k]):
                p.grad = g.clone()
            opt.step()
    for x, y in zip(a, b):
        assert_bits(x.detach(), y.detach(), "param after resume")
        assert_bits(oa.state[x]["exp_avg"], ob.state[y]["exp_avg"], "exp_avg after resume")


@pytest.mark.parametrize("kwargs,name", [
    (dict(lr=-1e-3), "lr"), (dict(lr=math.nan), "lr"), (dict(betas=(1.5, 0.99)), "beta1"),
    (dict(betas=(0.9, -0.1)), "beta2"), (dict(betas=(0.9,)), "betas"),
    (dict(weight_decay=-0.1), "weight_decay"), (dict(lr=0.5, weight_decay=3.0), "weight_decay")])
def test_lion_bad_hyper_parameters_are_named(kwargs, name):
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=name):
        st.Lion([p], **kwargs)
    # A group changed later is refused at the step, before any tensor is written.
    opt = st.Lion([p])
    p.grad = torch.ones(3)
    for k, v in kwargs.items():
        opt.param_groups[0][k] = v
    before = p.detach().clone()
    with pytest.raises(ValueError, match=name):
        opt.step()
    assert_bits(p.detach(), before, "param after a refused step")
    assert not opt.state.get(p)


def test_engine_step_by_name_runs_lion():
    e = stepcore.Engine()
    gen = torch.Generator().manual_seed(9)
    p, g, m = torch.randn(40, generator=gen), make_grad(40, gen), torch.randn(40, generator=gen)
    want_p, want_m = lion_expected(p, g, m, 1e-3, 0.9, 0.99, 0.05)
    e.step("lion", [p], [[m]], None, [g], hyper=dict(lr=1e-3, weight_decay=0.05))
    assert_bits(p, want_p, "param")
    assert_bits(m, want_m, "exp_avg")
    assert stepcore.optimizers()["lion"] == dict(lr=1e-4, beta1=0.9, beta2=0.99,
                                                 weight_decay=0.0)
