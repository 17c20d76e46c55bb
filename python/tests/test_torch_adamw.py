"""Tests of stepcore.torch.AdamW and SignSGD against independent expectations.

AdamW is compared bit for bit with torch.optim.AdamW(fused=True) on CPU (params, moments,
step and unscaled gradients after every step), across sizes, gradient dtypes, weight
decay, betas, param groups, an LR schedule, AMP grad_scale/found_inf and every ISA;
state_dict round trips in both directions; SignSGD against the formula of
docs/numerics.md section 8 evaluated with an exactly rounded fma written here; bad input
(an exception naming the argument, nothing changed); two threads at once.
"""

import copy
import hashlib
import math
import os
import random
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch", reason="stepcore.torch tests need PyTorch")
np = pytest.importorskip("numpy", reason="stepcore.torch tests need numpy")

import stepcore  # noqa: E402
import stepcore.torch as st  # noqa: E402

ISAS = stepcore.supported_isas()
SIZES = [0, 1, 7, 8, 15, 16, 17, 31, 33, 100, 257, 1025, 65537]
BIG = random.Random(20240607).randrange(999_001, 1_001_000, 2)  # odd: a partial last vector


def bits(t):
    """Returns the bit pattern of an f32/bf16/f16 tensor as integers (NaN-safe equality)."""
    t = t.detach()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def assert_bits(a, b, what):
    """Asserts two tensors are bit-identical, reporting the first difference."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    ba, bb = bits(a), bits(b)
    if not torch.equal(ba, bb):
        i = int((ba != bb).nonzero()[0])
        raise AssertionError(f"{what}: element {i} of {a.numel()}: {a.flatten()[i].item()!r} "
                             f"vs {b.flatten()[i].item()!r}")


def make_grad(n, gen):
    """Returns an f32 gradient with magnitudes over many binades and some exact zeros."""
    g = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    g[::13] = 0.0
    return g


def allow_any_grad_dtype(p):
    """Lets a bf16/f16 gradient be assigned to an f32 param (torch >= 2.10 has grad_dtype)."""
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None


def schedule(step):
    """Warm-up (3 steps) then cosine decay over 7: the LambdaLR multiplier."""
    return (step + 1) / 3 if step < 3 else 0.5 * (1 + math.cos(math.pi * (step - 3) / 7))


# AMP per step: (grad_scale, found_inf) or None. A non-power-of-two scale shows division.
AMP = {2: (65536.0, 0.0), 4: (3.0, 0.0), 6: (1024.0, 1.0), 8: (0.75, 0.0)}


def run_against_torch(sizes, grad_dtype, wd, betas, isa, steps=10, amp=AMP, seed=0):
    """Steps stepcore and torch fused AdamW side by side and checks every bit after each step."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen) for n in sizes]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    half = len(sizes) // 2

    def groups(ps):
        return [{"params": ps[:half]}, {"params": ps[half:], "lr": 3e-3, "weight_decay": wd / 2}]

    o_ours = st.AdamW(groups(ours), lr=1e-2, betas=betas, weight_decay=wd, isa=isa)
    o_ref = torch.optim.AdamW(groups(ref), lr=1e-2, betas=betas, weight_decay=wd, fused=True)
    s_ours = torch.optim.lr_scheduler.LambdaLR(o_ours, schedule)
    s_ref = torch.optim.lr_scheduler.LambdaLR(o_ref, schedule)
    for p in ours:
        allow_any_grad_dtype(p)
    for k in range(steps):
        for p, q in zip(ours, ref):
            g = make_grad(p.numel(), gen).to(grad_dtype)
            p.grad = g.clone()
            q.grad = g.float()  # the exact f32 widening
        scale, found = amp.get(k, (None, None))
        for o in (o_ours, o_ref):
            o.grad_scale = None if scale is None else torch.tensor(scale)
            o.found_inf = None if found is None else torch.tensor(found)
        o_ours.step()
        o_ref.step()
        s_ours.step()
        s_ref.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            what = f"isa={isa} step {k} param {i} (n={p.numel()})"
            assert_bits(p, q, what + " param")
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert_bits(o_ours.state[p][key], o_ref.state[q][key], f"{what} {key}")
            assert_bits(p.grad, q.grad.to(grad_dtype), what + " grad (unscaled in place)")
    assert o_ours.state[ours[1]]["step"].item() == steps - 1  # the found_inf step was skipped


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.95)])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_adamw_bitwise_vs_torch_fused(grad_dtype, wd, betas, isa):
    run_against_torch(SIZES, grad_dtype, wd, betas, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_adamw_bitwise_vs_torch_fused_large(grad_dtype, isa):
    run_against_torch([BIG, 65537, 33], grad_dtype, 0.1, (0.9, 0.999), isa, steps=10, seed=1)


def test_adamw_f16_grads_and_threads():
    for threads in (1, 2):
        gen = torch.Generator().manual_seed(5)
        p = torch.nn.Parameter(torch.randn(40_003, generator=gen))
        q = torch.nn.Parameter(p.detach().clone())
        allow_any_grad_dtype(p)
        o = st.AdamW([p], lr=1e-3, threads=threads)
        r = torch.optim.AdamW([q], lr=1e-3, fused=True)
        for _ in range(3):
            g = (torch.randn(p.numel(), generator=gen) * 0.01).half()
            p.grad, q.grad = g.clone(), g.float()
            o.step()
            r.step()
            assert_bits(p, q, f"threads={threads} f16 grads")


def test_grad_scaler_protocol():
    """torch.amp.GradScaler drives stepcore's AdamW exactly as it drives torch's fused one."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))
    twin = copy.deepcopy(model)
    o = st.AdamW(model.parameters(), lr=1e-2)
    r = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    s_o = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    s_r = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(32, 9)
    for k in range(4):
        for m, opt, sc in ((model, o, s_o), (twin, r, s_r)):
            opt.zero_grad()
            loss = m(x).square().mean()
            if k == 2:
                loss = loss * float("inf")  # an overflow: both must skip the step
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        assert s_o.get_scale() == s_r.get_scale()
        for a, b in zip(model.parameters(), twin.parameters()):
            assert_bits(a, b, f"GradScaler step {k}")
            assert_bits(o.state[a]["step"], r.state[b]["step"], "step")


def test_found_inf_changes_nothing():
    p = torch.nn.Parameter(torch.randn(19))
    o = st.AdamW([p], lr=0.1)
    p.grad = torch.randn(19)
    o.step()
    before = [t.clone() for t in (p.detach(), p.grad, *o.state[p].values())]
    o.step(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(1.0))
    after = [p.detach(), p.grad, *o.state[p].values()]
    for a, b in zip(before, after):
        assert_bits(a, b, "found_inf=1")


# ---- state_dict interop ------------------------------------------------------------


def grads_for(ps, gen):
    """Returns one fresh gradient per param."""
    return [make_grad(p.numel(), gen) for p in ps]


def apply(ps, gs):
    """Sets p.grad = copy of g for each pair."""
    for p, g in zip(ps, gs):
        p.grad = g.clone()


@pytest.mark.parametrize("direction,source_fused", [
    ("torch_to_stepcore", True), ("torch_to_stepcore", False), ("stepcore_to_torch", True)],
    ids=["torch_fused_to_stepcore", "torch_foreach_to_stepcore", "stepcore_to_torch"])
def test_state_dict_round_trip(direction, source_fused):
    gen = torch.Generator().manual_seed(11)
    sizes = [3, 17, 1025]
    init = [torch.randn(n, generator=gen) for n in sizes]
    first = [torch.nn.Parameter(x.clone()) for x in init]
    groups = lambda ps: [{"params": ps[:1]}, {"params": ps[1:], "lr": 5e-3}]  # noqa: E731
    hyper = dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05)
    if direction == "torch_to_stepcore":
        src = torch.optim.AdamW(groups(first), fused=source_fused,
                                foreach=None if source_fused else True, **hyper)
    else:
        src = st.AdamW(groups(first), **hyper)
    sched = torch.optim.lr_scheduler.LambdaLR(src, schedule)
    for _ in range(3):
        apply(first, grads_for(first, gen))
        src.step()
        sched.step()
    sd = copy.deepcopy(src.state_dict())
    sched_sd = copy.deepcopy(sched.state_dict())
    # The continuation under test and the reference: torch fused continuing the same state.
    cont = [torch.nn.Parameter(p.detach().clone()) for p in first]
    refp = [torch.nn.Parameter(p.detach().clone()) for p in first]
    dst = (st.AdamW(groups(cont), **hyper) if direction == "torch_to_stepcore"
           else torch.optim.AdamW(groups(cont), fused=True, **hyper))
    ref = torch.optim.AdamW(groups(refp), fused=True, **hyper)
    d_sched = torch.optim.lr_scheduler.LambdaLR(dst, schedule)
    r_sched = torch.optim.lr_scheduler.LambdaLR(ref, schedule)
    d_sched.load_state_dict(sched_sd)
    r_sched.load_state_dict(copy.deepcopy(sched_sd))
    dst.load_state_dict(sd)
    ref.load_state_dict(copy.deepcopy(sd))
    for group in ref.param_groups:  # loading a foreach state_dict also loads fused=None
        group["fused"], group["foreach"] = True, None
    for group in dst.param_groups:
        assert group["fused"] is True  # so torch continues with its fused kernel
    for p in cont:
        s = dst.state[p]["step"]
        assert s.dtype == torch.float32 and s.dim() == 0 and s.device.type == "cpu"
    for k in range(3):
        gs = grads_for(cont, gen)
        apply(cont, gs)
        apply(refp, gs)
        dst.step()
        ref.step()
        d_sched.step()
        r_sched.step()
        for i, (a, b) in enumerate(zip(cont, refp)):
            assert_bits(a, b, f"{direction} continued step {k} param {i}")
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert_bits(dst.state[a][key], ref.state[b][key], f"{key} {i}")
    # and the state_dict written after continuing has torch's layout
    out = dst.state_dict()
    assert set(out["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_deepcopy_and_pickle_keep_engine_and_state():
    import pickle

    p = torch.nn.Parameter(torch.randn(50))
    o = st.AdamW([p], lr=1e-2, isa=ISAS[0], threads=1)
    p.grad = torch.randn(50)
    o.step()
    for clone in (copy.deepcopy(o), pickle.loads(pickle.dumps(o))):
        assert clone.engine.isa == ISAS[0] and clone.engine.threads == 1
        q = clone.param_groups[0]["params"][0]
        assert_bits(clone.state[q]["exp_avg"], o.state[p]["exp_avg"], "copied state")
        q.grad = p.grad.clone()
        clone.step()
        assert clone.state[q]["step"].item() == 2


@pytest.mark.parametrize("option", ["capturable", "differentiable"])
def test_state_dict_rejects_unsupported_options(option):
    p = torch.nn.Parameter(torch.randn(4))
    t = torch.optim.AdamW([p])
    p.grad = torch.randn(4)
    t.step()
    sd = t.state_dict()
    sd["param_groups"][0][option] = True
    o = st.AdamW([torch.nn.Parameter(torch.randn(4))])
    with pytest.raises(NotImplementedError, match=option):
        o.load_state_dict(sd)


# ---- compute copies ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_copy(dtype):
    gen = torch.Generator().manual_seed(2)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (5, 300)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    compute = torch.empty(300, dtype=dtype)
    o = st.AdamW(ps, lr=1e-2)
    o.set_compute_copy(ps[1], compute)
    r = torch.optim.AdamW(qs, lr=1e-2, fused=True)
    for _ in range(2):
        gs = grads_for(ps, gen)
        apply(ps, gs)
        apply(qs, gs)
        o.step()
        r.step()
        assert_bits(ps[1], qs[1], "param with a compute copy")
        assert_bits(compute, qs[1].detach().to(dtype), "compute copy = R(p)")
    s = st.SignSGD(ps, lr=1e-3)
    s.set_compute_copy(ps[0], torch.empty(5, dtype=dtype))
    with pytest.raises(ValueError, match="not in this optimizer"):
        s.set_compute_copy(torch.nn.Parameter(torch.zeros(5)), torch.empty(5, dtype=dtype))
    with pytest.raises(ValueError, match="elements"):
        s.set_compute_copy(ps[0], torch.empty(6, dtype=dtype))


# ---- SignSGD -----------------------------------------------------------------------


def fma_f32(a, b, c):
    """Returns fma(a, b, c) correctly rounded to f32 for f32 numpy arrays (a*b exact in f64)."""
    a64, b64, c64 = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
    prod = a64 * b64                          # exact: 24 + 24 bits
    s = prod + c64                            # rounded to f64 ...
    bv = s - prod
    err = (prod - (s - bv)) + (c64 - bv)      # ... with its exact error (TwoSum)
    r = s.astype(np.float32)
    # Double rounding only errs when s sits exactly on an f32 midpoint and err != 0:
    # then the exact value lies on err's side of it.
    with np.errstate(invalid="ignore", over="ignore"):
        toward = np.nextafter(r, np.where(s > r.astype(np.float64), np.inf, -np.inf)
                              .astype(np.float32))
        mid = (r.astype(np.float64) + toward.astype(np.float64)) / 2
        fix = np.isfinite(s) & (s != r.astype(np.float64)) & (s == mid) & (err != 0)
        other = np.where(fix & ((err > 0) == (toward > r)), toward, r)
    return np.where(fix, other, r).astype(np.float32)


def sign_sgd_expected(p, g, lr, wd):
    """docs/numerics.md 8: s = sign(g) (+0 for ±0, NaN for NaN: g's own NaN, payload kept);
    p = fma(p, -(lr*wd), p) if wd > 0; p = fma(s, -lr, p); scalars f32 from double."""
    p = p.numpy().astype(np.float32)
    g = g.float().numpy()
    s = np.where(g > 0, 1.0, np.where(g < 0, -1.0, np.where(np.isnan(g), g, 0.0)))
    s = s.astype(np.float32)
    if wd > 0:
        p = fma_f32(p, np.float32(-(lr * wd)), p)
    return torch.from_numpy(fma_f32(s, np.float32(-lr), p).copy())


def test_fma_helper_is_exact():
    # a*b = 2^-24 + 2^-60 (1774001 * 38737 = 2^36 + 1): 1 + a*b rounds in f64 onto the f32
    # midpoint 1 + 2^-24, where a second rounding goes to even (1); the exact value is
    # above the midpoint, so the correctly rounded fma is 1 + 2^-23.
    a = np.float32(1774001 * 2.0**-30)
    b = np.float32(38737 * 2.0**-30)
    assert np.float64(a) * np.float64(b) == 2.0**-24 + 2.0**-60
    assert np.float32(np.float64(a) * np.float64(b) + 1.0) == np.float32(1.0)
    got = fma_f32(np.array([a]), np.array([b]), np.array([np.float32(1.0)]))[0]
    assert got == np.float32(1 + 2.0**-23)
    got = fma_f32(np.array([-a]), np.array([b]), np.array([np.float32(-1.0)]))[0]
    assert got == np.float32(-(1 + 2.0**-23))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("lr,wd", [(1e-3, 0.0), (0.37, 0.1), (3e-4, 0.01)])
def test_sign_sgd_vs_formula(grad_dtype, lr, wd, isa):
    gen = torch.Generator().manual_seed(7)
    sizes = [0, 1, 7, 17, 1025, 65537]
    ps = [torch.nn.Parameter(make_grad(n, gen)) for n in sizes]
    for p in ps:
        allow_any_grad_dtype(p)
    with torch.no_grad():
        ps[3][:4] = torch.tensor([0.0, -0.0, 0.0, -0.0])   # signed zero params
    o = st.SignSGD([{"params": ps[:3]}, {"params": ps[3:]}], lr=lr, weight_decay=wd, isa=isa)
    for k in range(3):
        gs = [make_grad(p.numel(), gen).to(grad_dtype) for p in ps]
        if gs[4].numel():
            gs[4][:4] = torch.tensor([0.0, -0.0, float("nan"), float("inf")]).to(grad_dtype)
            gs[3][:4] = torch.tensor([0.0, -0.0, 1.0, -1.0]).to(grad_dtype)
        expect = [sign_sgd_expected(p.detach(), g, lr, wd) for p, g in zip(ps, gs)]
        apply(ps, gs)
        o.step()
        for i, (p, e) in enumerate(zip(ps, expect)):
            assert_bits(p, e, f"SignSGD step {k} param {i}")
        assert math.isnan(ps[4][2].item())  # sign(NaN) = NaN, unlike torch.sign
        with torch.no_grad():
            ps[4][2] = 0.0


# ---- options and hyper-parameters --------------------------------------------------


@pytest.mark.parametrize("option", ["capturable", "differentiable"])
def test_unsupported_options_raise(option):
    with pytest.raises(NotImplementedError, match=option):
        st.AdamW([torch.nn.Parameter(torch.zeros(2))], **{option: True})


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_unsupported_params_raise():
    with pytest.raises(NotImplementedError, match="fused"):
        st.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=False)
    with pytest.raises(NotImplementedError, match="float64.*compute in float32"):
        st.AdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    with pytest.raises(NotImplementedError, match="non-CPU params"):
        st.AdamW([torch.nn.Parameter(torch.zeros(2, device="meta"))])
    with pytest.raises(NotImplementedError, match="non-CPU params"):
        st.SignSGD([torch.nn.Parameter(torch.zeros(2, device="meta"))])
    p = torch.nn.Parameter(torch.zeros(3))
    o = st.AdamW([p])
    p.grad = torch.sparse_coo_tensor([[0]], [1.0], (3,))
    with pytest.raises(NotImplementedError, match="sparse"):
        o.step()


def assert_raises_like_torch(ours, theirs, *args, **kwargs):
    """Asserts that ours(*args, **kwargs) raises torch's exception for theirs(...): the same
    type and message (torch's constructor checks, run on the same arguments)."""
    with pytest.raises(Exception) as want:
        theirs(*args, **kwargs)
    with pytest.raises(Exception) as got:
        ours(*args, **kwargs)
    assert type(got.value) is type(want.value), (got.value, want.value)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("kwargs", [
    dict(lr=-1.0), dict(lr=float("nan")), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)),
    dict(eps=-1e-8), dict(weight_decay=-0.1), dict(betas=(0.9, torch.tensor(0.99))),
    dict(fused=True, foreach=True), dict(fused=True, differentiable=True)])
def test_arguments_torch_refuses_raise_torchs_exception(kwargs):
    assert_raises_like_torch(st.AdamW, torch.optim.AdamW,
                             [torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize("kwargs,name", [
    (dict(eps=0.0), "eps"), (dict(weight_decay=float("inf")), "weight_decay"),
    (dict(lr=float("inf")), "lr"), (dict(lr=2.0, weight_decay=1.0), "weight_decay")])
def test_invalid_hyper_parameters_raise(kwargs, name):
    """What torch takes but stepcore's bounds refuse (docs/numerics.md 9): ValueError naming it."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True, **kwargs)  # torch takes it
    with pytest.raises(ValueError, match=name):
        st.AdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_add_param_group_checks_the_group():
    o = st.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"param_groups\[1\].*beta1"):
        o.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "betas": (1.5, 0.9)})
    with pytest.raises(NotImplementedError, match="capturable"):
        o.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "capturable": True})
    with pytest.raises(NotImplementedError, match="float64"):
        o.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2).double())]})
    assert len(o.param_groups) == 1
    o.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.5})
    assert len(o.param_groups) == 2 and o.param_groups[1]["fused"] is True


# ---- bad input: an exception naming the argument, nothing changed ------------------


def fingerprint(tensors):
    """Returns a digest of the tensors' bytes."""
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            h.update(str(t.dtype).encode())
    return h.hexdigest()


def two_group_setup():
    """Returns (optimizer, params): group 0 fine, group 1 about to be broken."""
    gen = torch.Generator().manual_seed(9)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (33, 12)]
    o = st.AdamW([{"params": ps[:1]}, {"params": ps[1:]}], lr=1e-2)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    o.step()  # state exists for both
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    return o, ps


def everything(o, ps):
    """Returns every tensor the step could write."""
    out = []
    for p in ps:
        out += [p, p.grad, *o.state[p].values()]
    return out


@pytest.mark.parametrize("breakage,match", [
    ("non_contiguous_grad", r"param_groups\[1\]\['params'\]\[0\]\.grad.*contiguous"),
    ("float64_grad", r"param_groups\[1\]\['params'\]\[0\]\.grad.*float64"),
    ("nan_lr", r"param_groups\[1\].*lr"),
    ("non_contiguous_state", r"param_groups\[1\]\['params'\]\[0\].*exp_avg.*contiguous"),
    ("meta_state", r"param_groups\[1\]\['params'\]\[0\].*exp_avg_sq.*meta"),
])
def test_bad_input_names_argument_and_changes_nothing(breakage, match):
    o, ps = two_group_setup()
    p = ps[1]
    allow_any_grad_dtype(p)
    if breakage == "non_contiguous_grad":
        p.grad = torch.randn(24)[::2]
    elif breakage == "float64_grad":
        p.grad = torch.randn(12, dtype=torch.float64)
    elif breakage == "nan_lr":
        o.param_groups[1]["lr"] = float("nan")
    elif breakage == "non_contiguous_state":
        o.state[p]["exp_avg"] = torch.zeros(24)[::2]
    elif breakage == "meta_state":
        o.state[p]["exp_avg_sq"] = torch.zeros(12, device="meta")
    tensors = [t for t in everything(o, ps) if t.device.type == "cpu"]
    before = fingerprint(tensors)
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=match):
        o.step()
    assert fingerprint(tensors) == before


def test_bad_grad_scale_changes_nothing():
    o, ps = two_group_setup()
    tensors = everything(o, ps)
    before = fingerprint(tensors)
    o.param_groups[1]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match="beta2"):
        o.step(grad_scale=torch.tensor(4.0), found_inf=torch.tensor(0.0))
    assert fingerprint(tensors) == before


def test_lazy_state_not_created_on_error():
    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(4, generator=gen)) for _ in range(2)]
    o = st.AdamW([{"params": ps[:1]}, {"params": ps[1:]}])
    ps[0].grad = torch.randn(4)
    ps[1].grad = torch.randn(8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        o.step()
    assert len(o.state) == 0


def test_engine_error_in_a_later_group_keeps_earlier_state():
    """An error only the engine sees (an overlap) in group 1: group 0 has stepped and keeps
    its new state; group 1's lazily created state is removed."""
    ps = [torch.nn.Parameter(torch.randn(6)) for _ in range(2)]
    o = st.AdamW([{"params": ps[:1]}, {"params": ps[1:]}])
    for p in ps:
        p.grad = torch.randn(6)
    o.set_compute_copy(ps[1], ps[1].grad)  # the output overlaps the gradient it reads
    with pytest.raises(ValueError, match="overlap"):
        o.step()
    assert o.state[ps[0]]["step"].item() == 1 and ps[1] not in o.state


# ---- the cached engine table: reused only while provably valid ---------------------


def twin_optimizers(sizes, seed, **kw):
    """Returns (ours, ref, stepcore AdamW, torch fused AdamW, generator) from the same start."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen) for n in sizes]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    for p in ours:
        allow_any_grad_dtype(p)
    return (ours, ref, st.AdamW(ours, lr=1e-2, weight_decay=0.1, **kw),
            torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True), gen)


def assert_twins(o, r, ours, ref, what):
    """Asserts params and state of both optimizers are bit-identical."""
    for i, (p, q) in enumerate(zip(ours, ref)):
        assert_bits(p, q, f"{what} param {i}")
        if q in r.state:
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert_bits(o.state[p][key], r.state[q][key], f"{what} {key} {i}")


def test_cached_step_after_grads_replaced_equals_torch():
    """In-place grads reuse the table; set_to_none, new dtypes, a param losing and regaining
    its grad rewrite or rebuild it; every step equals torch's fused AdamW."""
    ours, ref, o, r, gen = twin_optimizers([1, 7, 300, 33], 21)
    tables = []
    for k in range(8):
        if k in (2, 5):
            o.zero_grad(set_to_none=True)
            r.zero_grad(set_to_none=True)
        for i, (p, q) in enumerate(zip(ours, ref)):
            if k == 4 and i == 1:  # no grad this step: the param does not step
                p.grad = q.grad = None
                continue
            g = make_grad(p.numel(), gen).to(torch.bfloat16 if k == 3 else torch.float32)
            if p.grad is not None and p.grad.dtype == g.dtype:
                p.grad.copy_(g)  # the same grad objects: the cached rows as they are
                q.grad.copy_(g.float())
            else:
                p.grad, q.grad = g.clone(), g.float()
        o.step()
        r.step()
        tables.append(o._tables[0])
        assert_twins(o, r, ours, ref, f"step {k}")
    assert tables[1] is tables[0] and tables[3] is tables[2]  # reused, not rebuilt


def test_cached_step_after_param_data_replaced_equals_torch():
    ours, ref, o, r, gen = twin_optimizers([5, 64], 22)
    for k in range(5):
        if k == 2:
            new = torch.randn(64, generator=gen)
            ours[1].data = new.clone()  # new storage: the table must not write the old one
            ref[1].data = new.clone()
        gs = grads_for(ours, gen)
        apply(ours, gs)
        apply(ref, gs)
        o.step()
        r.step()
        assert_twins(o, r, ours, ref, f"step {k}")


def test_cached_step_after_add_param_group_equals_torch():
    ours, ref, o, r, gen = twin_optimizers([9, 17], 23)
    for k in range(5):
        if k == 2:
            x = torch.randn(40, generator=gen)
            ours.append(torch.nn.Parameter(x.clone()))
            ref.append(torch.nn.Parameter(x.clone()))
            o.add_param_group({"params": ours[2:], "lr": 3e-3})
            r.add_param_group({"params": ref[2:], "lr": 3e-3})
        gs = grads_for(ours, gen)
        apply(ours, gs)
        apply(ref, gs)
        o.step()
        r.step()
        assert_twins(o, r, ours, ref, f"step {k}")


def test_cached_step_with_grad_scale_and_compute_copy_equals_torch():
    ours, ref, o, r, gen = twin_optimizers([3, 70], 24)
    compute = torch.empty(70, dtype=torch.bfloat16)
    for k in range(5):
        if k == 2:
            o.set_compute_copy(ours[1], compute)
        gs = grads_for(ours, gen)
        for p, q, g in zip(ours, ref, gs):
            if p.grad is None:
                p.grad, q.grad = g.clone(), g.clone()
            else:
                p.grad.copy_(g)
                q.grad.copy_(g)
        for opt in (o, r):  # GradScaler's protocol: attributes the fused step reads
            opt.grad_scale = torch.tensor(3.0 if k % 2 else 1024.0)
            opt.found_inf = torch.tensor(0.0)
        o.step()
        r.step()
        assert_twins(o, r, ours, ref, f"step {k}")
        for p, q in zip(ours, ref):
            assert_bits(p.grad, q.grad, f"step {k} unscaled grad")
        if k >= 2:
            assert_bits(compute, ref[1].detach().to(torch.bfloat16), f"step {k} compute copy")


@pytest.mark.parametrize("breakage,error,match", [
    ("grad_data_non_contiguous", ValueError,
     r"param_groups\[1\]\['params'\]\[0\]\.grad.*contiguous"),
    ("grad_replaced_float64", TypeError, r"param_groups\[1\]\['params'\]\[0\]\.grad.*float64"),
    ("param_data_float64", NotImplementedError,
     r"param_groups\[1\]\['params'\]\[0\].*float64"),
    # a bf16 param takes its state in bf16 (torch's layout): the f32 exp_avg is named
    ("param_data_bf16", TypeError,
     r"param_groups\[1\]\['params'\]\[0\]\['exp_avg'\].*float32; expected bfloat16"),
    ("state_replaced_float64", TypeError,
     r"param_groups\[1\]\['params'\]\[0\].*exp_avg.*float64"),
    ("step_written_in_place", ValueError, r"param_groups\[1\]\['params'\]\[0\].*step"),
])
def test_bad_input_on_the_cached_path_names_argument_and_changes_nothing(breakage, error, match):
    """After two steps (the table cached), a breakage raises naming the argument (as the
    uncached step does) before anything is written, in every group."""
    o, ps = two_group_setup()
    o.step()  # the grads of two_group_setup: now every group's table is cached and reused
    p = ps[1]
    allow_any_grad_dtype(p)
    if breakage == "grad_data_non_contiguous":
        p.grad.data = torch.randn(24)[::2]  # the same grad object, new storage
    elif breakage == "grad_replaced_float64":
        p.grad = torch.randn(12, dtype=torch.float64)
    elif breakage == "param_data_float64":
        p.data = torch.zeros(12, dtype=torch.float64)
    elif breakage == "param_data_bf16":
        p.data = torch.zeros(12, dtype=torch.bfloat16)
    elif breakage == "state_replaced_float64":
        o.state[p]["exp_avg"] = torch.zeros(12, dtype=torch.float64)
    elif breakage == "step_written_in_place":
        o.state[p]["step"].fill_(2.0**24 - 1)  # the same tensor object, a value off limits
    tensors = everything(o, ps)
    before = fingerprint(tensors)
    with pytest.raises(error, match=match):
        o.step()
    assert fingerprint(tensors) == before


class _GradSubclass(torch.Tensor):
    """A plain tensor subclass: the cached rows do not take it (the list path does)."""


def test_grads_the_rows_do_not_take_go_through_the_list_path_with_torch_bits():
    """Grads of a tensor subclass skip the cached rows (Engine.step on detached
    tensors); the bits still equal torch's fused AdamW."""
    ours, ref, o, r, gen = twin_optimizers([5, 130], 25)
    for k in range(3):
        gs = grads_for(ours, gen)
        for p, q, g in zip(ours, ref, gs):
            p.grad = g.clone().as_subclass(_GradSubclass)
            q.grad = g.clone()
        o.step()
        r.step()
        assert not o._tables[0].usable
        assert_twins(o, r, ours, ref, f"step {k}")


def test_step_advances_the_version_of_params_and_compute_copies():
    """Autograd sees the in-place update of params and compute copies (as torch's does)."""
    ours, ref, o, r, gen = twin_optimizers([4, 9], 26)
    compute = torch.empty(9, dtype=torch.bfloat16)
    o.set_compute_copy(ours[1], compute)
    for k in range(2):
        apply(ours, grads_for(ours, gen))
        before = [p._version for p in ours] + [compute._version]
        o.step()
        after = [p._version for p in ours] + [compute._version]
        assert all(b > a for a, b in zip(before, after)), (before, after)
    w = torch.nn.Parameter(torch.ones(3))
    opt = st.AdamW([w], lr=0.1)
    y = (w * w).sum()  # saves w for backward
    w.grad = torch.ones(3)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_cached_rows_refuse_what_no_longer_matches():
    """The private rows re-read every step: stale objects make prepare() False (the full
    check then names them) and run() needs a prepare()."""
    e = stepcore.Engine(threads=1)
    ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    states = [dict(step=torch.zeros(()), exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3))]
    rows = stepcore._core._OptimizerRows(ps, [0], states, ["exp_avg", "exp_avg_sq"], "step",
                                         None, None, [torch.Tensor])
    h = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="prepare"):
        rows.run(e, "adamw", h)
    assert not rows.prepare(ps)  # params[0] has no grad
    ps[0].grad = torch.ones(3)
    assert rows.prepare(ps)
    rows.run(e, "adamw", h)
    assert float(states[0]["step"]) == 1.0
    assert not rows.prepare(list(reversed(ps)))  # other params
    ps[1].grad = torch.ones(2)
    assert not rows.prepare(ps)  # a param without state gained a grad
    ps[1].grad = None
    assert not rows.prepare(ps, [torch.ones(2)])  # given grads: numel differs
    assert not rows.prepare(ps, [torch.ones(6)[::2]])  # not contiguous
    assert rows.prepare(ps, [torch.ones(3, dtype=torch.bfloat16)])
    assert not rows.prepare(ps, [torch.ones(3, dtype=torch.float64)])  # a dtype it cannot read
    states[0]["exp_avg"] = torch.zeros(3)  # replaced: identity differs
    assert not rows.prepare(ps)


@pytest.mark.parametrize("mutation", ["replace", "same object again", "add", "remove and re-add",
                                      "clear and refill", "none"])
def test_cached_rows_see_every_change_of_a_state_dict(mutation):
    """The rows compare every entry of each state dict by identity, in order, on every
    step (no interpreter internals): an entry replaced, added, or removed and put back
    (another order) makes prepare() False; storing the object a key already holds, or
    nothing, keeps the rows."""
    e = stepcore.Engine(threads=1)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    st0 = dict(step=torch.zeros(()), exp_avg=torch.zeros(3), exp_avg_sq=torch.zeros(3))
    rows = stepcore._core._OptimizerRows([p], [0], [st0], ["exp_avg", "exp_avg_sq"], "step",
                                         None, None, [torch.Tensor])
    assert rows.prepare([p])
    kept = dict(st0)
    if mutation == "replace":
        st0["exp_avg_sq"] = torch.zeros(3)
    elif mutation == "same object again":
        st0["exp_avg"] = st0["exp_avg"]
    elif mutation == "add":
        st0["extra"] = 1
    elif mutation == "remove and re-add":
        st0["step"] = st0.pop("step")  # the same objects, another order
    elif mutation == "clear and refill":
        st0.clear()
        st0.update(exp_avg=kept["exp_avg"], step=kept["step"], exp_avg_sq=kept["exp_avg_sq"])
    assert rows.prepare([p]) == (mutation in ("same object again", "none"))


def test_same_items_compares_a_dict_with_its_snapshot_by_identity():
    """_core._same_items(d, keys, values): d holds exactly keys[k]: values[k] in order."""
    one, two = object(), object()
    d = {"a": one, "b": two}
    keys, values = list(d.keys()), list(d.values())
    same = stepcore._core._same_items
    assert same(d, keys, values)
    d["a"] = object()
    assert not same(d, keys, values)
    d["a"] = one
    assert same(d, keys, values)
    d["c"] = 3
    assert not same(d, keys, values)
    del d["c"]
    d["a"] = d.pop("a")
    assert not same(d, keys, values)  # another order
    assert not same({"a": one}, keys, values)
    with pytest.raises(TypeError, match="'d'"):
        same([1], keys, values)


@pytest.mark.parametrize("what", ["state tensor", "state dict", "state dict, same tensors"])
def test_state_replaced_between_steps_is_what_the_next_step_writes(what):
    """A state tensor or a param's whole state dict replaced between two cached steps: the
    next step reads and writes the new objects (the old ones keep their values), and its
    bits equal torch's fused AdamW given the same replacement."""
    gen = torch.Generator().manual_seed(7)
    init = [torch.randn(n, generator=gen) for n in (33, 5)]
    grads = [[make_grad(t.numel(), gen) for t in init] for _ in range(3)]
    results = []
    for cls, kw in ((st.AdamW, dict(threads=1)), (torch.optim.AdamW, dict(fused=True))):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = cls(ps, lr=1e-2, weight_decay=0.1, **kw)
        old = None
        for k, g in enumerate(grads):
            for p, gk in zip(ps, g):
                p.grad = gk.clone()
            if k == 2:
                s0 = opt.state[ps[0]]
                old = s0["exp_avg"]
                if what == "state tensor":
                    s0["exp_avg"] = old.clone()
                elif what == "state dict":
                    opt.state[ps[0]] = {key: v.clone() for key, v in s0.items()}
                else:
                    opt.state[ps[0]] = dict(s0)
            before = old.clone() if old is not None else None
            opt.step()
        new = opt.state[ps[0]]["exp_avg"]
        if what != "state dict, same tensors":
            assert new is not old
            assert_bits(old, before, "the replaced exp_avg kept its values")
        results.append([ps[0].detach(), ps[1].detach(), new])
    for a, b, name in zip(*results, ("param 0", "param 1", "exp_avg 0")):
        assert_bits(a, b, name)


def test_fast_import_takes_torch_tensors_through_the_c_exchange_api():
    """torch tensors reach the engine through the DLPack C exchange API (no __dlpack__)."""
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this torch has no DLPack C exchange API; the __dlpack__ path is used")
    e = stepcore.Engine(threads=1)
    before = stepcore._core._exchange_imports()
    e.scale_([torch.nn.Parameter(torch.ones(5)), torch.ones(2)], 2.0)
    assert stepcore._core._exchange_imports() - before == 2


# ---- threads -----------------------------------------------------------------------


def test_two_threads_disjoint_optimizers():
    """Two optimizers stepping at once (the engine releases the GIL) equal sequential runs."""
    def setup(seed):
        gen = torch.Generator().manual_seed(seed)
        ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (1_000_003, 4097)]
        gs = [[make_grad(p.numel(), gen) for p in ps] for _ in range(4)]
        return ps, gs

    def run(ps, gs, opt_cls, **kw):
        o = opt_cls(ps, threads=1, **kw)
        for step_grads in gs:
            apply(ps, step_grads)
            o.step()

    jobs = [(st.AdamW, dict(lr=1e-3)), (st.SignSGD, dict(lr=1e-3, weight_decay=0.1))]
    seq = [setup(s) for s in (1, 2)]
    par = [setup(s) for s in (1, 2)]
    for (ps, gs), (cls, kw) in zip(seq, jobs):
        run(ps, gs, cls, **kw)
    errors = []

    def worker(ps, gs, cls, kw):
        try:
            run(ps, gs, cls, **kw)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(ps, gs, cls, kw))
               for (ps, gs), (cls, kw) in zip(par, jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (a_ps, _), (b_ps, _) in zip(seq, par):
        for a, b in zip(a_ps, b_ps):
            assert_bits(a, b, "threaded vs sequential")


def test_import_stepcore_does_not_import_torch():
    code = "import sys, stepcore; assert 'torch' not in sys.modules, 'torch imported'"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_torchao_formula_equals_torchaos_adamw8bit_on_unquantized_tensors():
    """formula="torchao" against torchao.optim.AdamW8bit (its compiled CPU kernel) on
    tensors below its 4,096-element threshold, where it keeps f32 state: params and both
    moments bit for bit after every step, with decay and amsgrad (docs/numerics.md 8e)."""
    optim = pytest.importorskip("torchao.optim")
    gen = torch.Generator().manual_seed(8)
    init = torch.randn(1000, generator=gen) * 0.5
    for amsgrad in (False, True):
        ours = torch.nn.Parameter(init.clone())
        theirs = torch.nn.Parameter(init.clone())
        a = st.AdamW([ours], lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1, amsgrad=amsgrad,
                     formula="torchao")
        b = optim.AdamW8bit([theirs], lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1,
                            amsgrad=amsgrad)
        for step in range(4):
            g = make_grad(1000, gen)
            ours.grad, theirs.grad = g.clone(), g.clone()
            a.step()
            b.step()
            assert_bits(ours, theirs, f"param, step {step}, amsgrad {amsgrad}")
            for k in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
                assert_bits(a.state[ours][k], b.state[theirs][k], f"{k}, step {step}")
