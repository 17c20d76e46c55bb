"""Tests of stepcore.torch.Adam, SGD and Adagrad (and AdamW's amsgrad and maximize) against
torch.optim.X(fused=True) on CPU, and of the generic Engine.step they run on.

Every option of each optimizer, tensor sizes around torch's 8-wide vector body (0, 1, 7-9,
31-33, 1023-1025) and one ~10^6 case, 10 steps with two param groups, an LR schedule and
AMP grad_scale/found_inf: params, every state tensor, the unscaled grads and the state
layout equal torch's bit for bit (int32 views) after every step, on every ISA. torch 2.15
runs its AVX2 kernels (8 wide) on AVX-512 machines too, which the engine's default
torch_tail_width (8) reproduces (docs/numerics.md 7.2, 8a-8c); no ATEN_CPU_CAPABILITY is
needed. Also: state_dict round trips in both directions, GradScaler with an overflowing
step, hooks, zero_grad, constructor signatures and param_groups keys, bad arguments (torch's
exception type and message, from running torch's constructor on the same arguments), the
parser of Engine.step's optimizer names and hyper-parameters.
"""

import copy
import inspect
import math
import pickle

import pytest

torch = pytest.importorskip("torch", reason="stepcore.torch tests need PyTorch")
np = pytest.importorskip("numpy", reason="stepcore.torch tests need numpy")

import stepcore  # noqa: E402
import stepcore.torch as st  # noqa: E402
from test_torch_adamw import (  # noqa: E402
    BIG, ISAS, apply, assert_bits, assert_raises_like_torch, fingerprint, grads_for, make_grad,
    schedule, sign_sgd_expected)

SIZES = [0, 1, 7, 8, 9, 31, 32, 33, 1023, 1024, 1025]
# AMP per step: (grad_scale, found_inf). A non-power-of-two scale shows torch's division;
# never on step 0 (a skipped first SGD step leaves torch reading uninitialised buffers).
AMP = {2: (65536.0, 0.0), 4: (3.0, 0.0), 6: (1024.0, 1.0), 8: (0.75, 0.0)}

# (stepcore class, torch class, the extra arguments stepcore adds to torch's signature)
PAIRS = {
    "Adam": (st.Adam, torch.optim.Adam, {"threads", "isa", "formula"}),
    "AdamW": (st.AdamW, torch.optim.AdamW, {"threads", "isa", "formula"}),
    "SGD": (st.SGD, torch.optim.SGD, {"threads", "isa"}),
    "Adagrad": (st.Adagrad, torch.optim.Adagrad, {"threads", "isa"}),
}

# Every option of each optimizer (the second param group varies lr and weight decay).
ADAM_OPTIONS = [dict(amsgrad=a, maximize=m, weight_decay=wd)
                for a in (False, True) for m in (False, True) for wd in (0.0, 0.1)]
SGD_OPTIONS = [
    dict(momentum=0.0), dict(momentum=0.0, weight_decay=0.1, maximize=True),
    dict(momentum=0.9), dict(momentum=0.9, dampening=0.3), dict(momentum=0.8, nesterov=True),
    dict(momentum=0.9, weight_decay=0.05), dict(momentum=0.9, maximize=True, dampening=0.1),
    dict(momentum=0.7, nesterov=True, weight_decay=0.01, maximize=True)]
ADAGRAD_OPTIONS = [
    dict(), dict(lr_decay=0.047), dict(weight_decay=0.1), dict(initial_accumulator_value=0.3),
    dict(eps=1e-3), dict(maximize=True),
    dict(lr_decay=0.01, weight_decay=0.02, initial_accumulator_value=0.1, eps=1e-6,
         maximize=True)]
CASES = ([("Adam", o) for o in ADAM_OPTIONS] + [("AdamW", o) for o in ADAM_OPTIONS]
         + [("Adam", dict(decoupled_weight_decay=True, weight_decay=0.1)),
            ("Adam", dict(betas=(torch.tensor(0.8), torch.tensor(0.95)), amsgrad=True))]
         + [("SGD", o) for o in SGD_OPTIONS] + [("Adagrad", o) for o in ADAGRAD_OPTIONS])


def case_id(case):
    name, opts = case
    def text(v):
        return "tensors" if isinstance(v, tuple) and torch.is_tensor(v[0]) else v
    return name + "-" + ",".join(f"{k}={text(v)}" for k, v in opts.items())


def assert_torch_bits(a, b, what):
    """assert_bits, except that an f16 NaN is compared as NaN-ness: stepcore stores every
    f16 NaN as 0x7E00, torch keeps the sign of the f32 NaN (docs/numerics.md 2, 7.3)."""
    if a.dtype == torch.float16:
        nan_a, nan_b = torch.isnan(a.detach()), torch.isnan(b.detach())
        assert torch.equal(nan_a, nan_b), f"{what}: NaN at different elements"
        a, b = a.detach().masked_fill(nan_a, 0.0), b.detach().masked_fill(nan_b, 0.0)
    assert_bits(a, b, what)


def run_against_torch(name, opts, sizes, isa, steps=10, amp=AMP, seed=0, threads=0,
                      dtype=torch.float32):
    """Steps the stepcore drop-in and torch's fused optimizer side by side (two groups, a
    LambdaLR) and checks params, state (keys and bits) and grads after every step. Params,
    their grads and (as torch keeps it) their state in `dtype`."""
    ours_cls, torch_cls, _ = PAIRS[name]
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    half = len(sizes) // 2
    wd2 = opts.get("weight_decay", 0.0) / 2

    def groups(ps):
        return [{"params": ps[:half]}, {"params": ps[half:], "lr": 3e-3, "weight_decay": wd2}]

    o = ours_cls(groups(ours), lr=1e-2, isa=isa, threads=threads, **opts)
    r = torch_cls(groups(ref), lr=1e-2, fused=True, **opts)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(x, schedule) for x in (o, r)]
    for k in range(steps):
        for p, q in zip(ours, ref):
            g = make_grad(p.numel(), gen).to(dtype)
            p.grad, q.grad = g.clone(), g.clone()
        scale, found = amp.get(k, (None, None))
        for x in (o, r):
            x.grad_scale = None if scale is None else torch.tensor(scale)
            x.found_inf = None if found is None else torch.tensor(found)
        o.step()
        r.step()
        for s in schedulers:
            s.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            what = f"{name} {opts} isa={isa} step {k} param {i} (n={p.numel()})"
            assert_torch_bits(p, q, what + " param")
            assert_torch_bits(p.grad, q.grad, what + " grad (unscaled in place)")
            assert list(o.state.get(p, {})) == list(r.state.get(q, {})), what + " state keys"
            for key, value in r.state.get(q, {}).items():
                assert_torch_bits(o.state[p][key], value, f"{what} {key}")
    assert len(o.state) == len(r.state)
    return o, r


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bitwise_vs_torch_fused(case, isa):
    run_against_torch(*case, SIZES, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_16bit_params_bitwise_vs_torch_fused(case, dtype, isa):
    """bf16/f16 params keep their state in their dtype, as torch's fused kernels: math in
    f32, each store rounded to nearest even (docs/numerics.md 7.3); torch's vector holds 16
    lanes of a 16-bit type, so its tail is the last numel mod 16 elements."""
    run_against_torch(*case, SIZES, isa, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", [("AdamW", dict(weight_decay=0.1)),
                                  ("SGD", dict(momentum=0.9, weight_decay=0.1)),
                                  ("Adagrad", dict(lr_decay=0.01))], ids=case_id)
def test_16bit_params_large_and_threads(case, dtype):
    run_against_torch(*case, [BIG, 17], None, steps=3, amp={1: (3.0, 0.0)}, seed=2,
                      threads=3, dtype=dtype)


def test_16bit_param_refuses_a_compute_copy_before_writing():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    o = st.AdamW([p])
    o.set_compute_copy(p, torch.empty(4, dtype=torch.float16))
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"compute copy of param_groups\[0\]\['params'\]\[0\]"):
        o.step()
    assert_bits(p.detach(), torch.ones(4, dtype=torch.bfloat16), "param after the refused step")
    assert not o.state.get(p)


@pytest.mark.parametrize("case", [("Adam", dict(amsgrad=True, weight_decay=0.1)),
                                  ("SGD", dict(momentum=0.9, nesterov=True, weight_decay=0.1)),
                                  ("Adagrad", dict(lr_decay=0.01, weight_decay=0.1))],
                         ids=case_id)
def test_bitwise_vs_torch_fused_large(case):
    run_against_torch(*case, [BIG, 33], ISAS[-1], seed=1)


@pytest.mark.parametrize("threads", [1, 3])
def test_threads_do_not_change_bits(threads):
    for name, opts in (("SGD", dict(momentum=0.9)), ("Adagrad", dict(lr_decay=0.1)),
                       ("Adam", dict(amsgrad=True))):
        o, _ = run_against_torch(name, opts, [65537, 9], None, steps=3, threads=threads)
        assert o.engine.threads == threads


# ---- optimizer-specific behaviour ----------------------------------------------------


def test_sgd_without_momentum_keeps_no_state_like_torch():
    o, r = run_against_torch("SGD", dict(momentum=0.0), [5, 9], None, steps=2)
    assert o.state_dict()["state"] == r.state_dict()["state"] == {}


def test_sgd_param_gaining_its_grad_later_starts_its_buffer_then():
    """A param without a grad for two steps (no buffer) then one: its first step is then
    (torch's fused SGD refuses such a group; per param it is torch's first step)."""
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(n, generator=gen) for n in (17, 9)]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    refs = [torch.nn.Parameter(x.clone()) for x in init]
    kw = dict(lr=0.1, momentum=0.9, dampening=0.2)
    o = st.SGD(ours, **kw)
    r = [torch.optim.SGD([q], fused=True, **kw) for q in refs]  # each param on its own
    for k in range(5):
        for i, (p, q) in enumerate(zip(ours, refs)):
            if i == 1 and k < 2:
                p.grad = q.grad = None
                continue
            g = make_grad(p.numel(), gen)
            p.grad, q.grad = g.clone(), g.clone()
        o.step()
        for x in r:
            x.step()
        for i, (p, q) in enumerate(zip(ours, refs)):
            assert_bits(p, q, f"step {k} param {i}")
    assert (ours[1] in o.state) and len(o.state) == 2


def test_sgd_skipped_first_step_leaves_the_next_step_first():
    """found_inf on the first step: nothing is written and no buffer kept, so the next step
    is the first (torch would keep uninitialised buffers); equals torch without that step."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(33, generator=gen)
    p, q = torch.nn.Parameter(x.clone()), torch.nn.Parameter(x.clone())
    o = st.SGD([p], lr=0.1, momentum=0.9)
    r = torch.optim.SGD([q], lr=0.1, momentum=0.9, fused=True)
    p.grad = make_grad(33, gen)
    o.step(grad_scale=torch.tensor(2.0), found_inf=torch.tensor(1.0))
    assert_bits(p, q, "skipped step")
    assert p not in o.state
    for k in range(3):
        g = make_grad(33, gen)
        p.grad, q.grad = g.clone(), g.clone()
        o.step()
        r.step()
        assert_bits(p, q, f"step {k}")
        assert_bits(o.state[p]["momentum_buffer"], r.state[q]["momentum_buffer"], "buffer")


def test_adagrad_state_at_construction_and_for_added_groups_like_torch():
    """torch creates every param's state in the constructor (sum = the constructor's
    initial_accumulator_value) and, for groups added later, at their first step with the
    constructor's value too (a group's own value is not used)."""
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(n, generator=gen) for n in (3, 10, 6)]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    o = st.Adagrad(ours[:2], lr=0.1, initial_accumulator_value=0.25)
    r = torch.optim.Adagrad(ref[:2], lr=0.1, initial_accumulator_value=0.25, fused=True)
    assert len(o.state) == len(r.state) == 2
    for p, q in zip(ours[:2], ref[:2]):
        assert list(o.state[p]) == list(r.state[q]) == ["step", "sum"]
        for key in ("step", "sum"):
            assert_bits(o.state[p][key], r.state[q][key], key)
    o.add_param_group({"params": ours[2:], "initial_accumulator_value": 0.5})
    r.add_param_group({"params": ref[2:], "initial_accumulator_value": 0.5})
    for k in range(3):
        gs = grads_for(ours, gen)
        apply(ours, gs)
        apply(ref, gs)
        o.step()
        r.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            assert_bits(p, q, f"step {k} param {i}")
            assert_bits(o.state[p]["sum"], r.state[q]["sum"], f"step {k} sum {i}")


def test_adamw_loading_an_adam_state_continues_as_adamw_like_torch():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(19, generator=gen)
    a = torch.nn.Parameter(x.clone())
    src = torch.optim.Adam([a], lr=1e-2, weight_decay=0.1, fused=True)
    a.grad = make_grad(19, gen)
    src.step()
    ps = [torch.nn.Parameter(a.detach().clone()) for _ in range(2)]
    o = st.AdamW([ps[0]], lr=1e-2, weight_decay=0.1)
    r = torch.optim.AdamW([ps[1]], lr=1e-2, weight_decay=0.1, fused=True)
    for opt in (o, r):
        opt.load_state_dict(copy.deepcopy(src.state_dict()))
        assert opt.param_groups[0]["decoupled_weight_decay"] is True
    g = make_grad(19, gen)
    ps[0].grad, ps[1].grad = g.clone(), g.clone()
    o.step()
    r.step()
    assert_bits(ps[0], ps[1], "AdamW continuing Adam's state")


# ---- state_dict interop --------------------------------------------------------------

ROUND_TRIPS = [("Adam", dict(amsgrad=True, weight_decay=0.05)),
               ("AdamW", dict(amsgrad=True, maximize=True)),
               ("SGD", dict(momentum=0.9, nesterov=True)), ("SGD", dict(momentum=0.0)),
               ("Adagrad", dict(lr_decay=0.01, initial_accumulator_value=0.1))]


@pytest.mark.parametrize("direction", ["torch_fused_to_stepcore", "torch_foreach_to_stepcore",
                                       "stepcore_to_torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", ROUND_TRIPS, ids=case_id)
def test_state_dict_round_trip(case, direction, dtype):
    """3 steps by one side, its state_dict (and the scheduler's) loaded by the other, 3 more
    steps: equal to torch's fused optimizer continuing from the same state_dict. Params (and
    so their state) in `dtype`."""
    name, opts = case
    ours_cls, torch_cls, _ = PAIRS[name]
    gen = torch.Generator().manual_seed(11)
    sizes = [3, 17, 1025]
    first = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]

    def grads(ps):
        return [g.to(dtype) for g in grads_for(ps, gen)]

    def groups(ps):
        return [{"params": ps[:1]}, {"params": ps[1:], "lr": 5e-3}]

    if direction == "stepcore_to_torch":
        src = ours_cls(groups(first), lr=1e-2, **opts)
    else:
        fused = direction == "torch_fused_to_stepcore"
        src = torch_cls(groups(first), lr=1e-2, fused=fused, foreach=None if fused else True,
                        **opts)
    sched = torch.optim.lr_scheduler.LambdaLR(src, schedule)
    for _ in range(3):
        apply(first, grads(first))
        src.step()
        sched.step()
    sd = copy.deepcopy(src.state_dict())
    sched_sd = copy.deepcopy(sched.state_dict())
    # The continuation under test and the reference: torch fused continuing the same state.
    cont = [torch.nn.Parameter(p.detach().clone()) for p in first]
    refp = [torch.nn.Parameter(p.detach().clone()) for p in first]
    dst = (torch_cls(groups(cont), lr=1e-2, fused=True, **opts)
           if direction == "stepcore_to_torch" else ours_cls(groups(cont), lr=1e-2, **opts))
    ref = torch_cls(groups(refp), lr=1e-2, fused=True, **opts)
    scheds = [torch.optim.lr_scheduler.LambdaLR(x, schedule) for x in (dst, ref)]
    for s_, o_ in zip(scheds, (dst, ref)):
        s_.load_state_dict(copy.deepcopy(sched_sd))
        o_.load_state_dict(copy.deepcopy(sd))
    for group in ref.param_groups:  # loading a foreach state_dict also loads fused=None
        group["fused"], group["foreach"] = True, None
    for group in dst.param_groups:
        assert group["fused"] is True  # torch continues with its fused kernel
    for k in range(3):
        gs = grads(cont)
        apply(cont, gs)
        apply(refp, gs)
        for x in (dst, ref, *scheds):
            x.step()
        for i, (a, b) in enumerate(zip(cont, refp)):
            what = f"{direction} continued step {k} param {i}"
            assert_torch_bits(a, b, what)
            assert list(dst.state.get(a, {})) == list(ref.state.get(b, {})), what
            for key, value in ref.state.get(b, {}).items():
                assert_torch_bits(dst.state[a][key], value, f"{what} {key}")
                if key == "step":
                    assert value.dtype == torch.float32 and value.dim() == 0
    # the state_dict stepcore writes has torch's fused layout
    mine = (dst if direction != "stepcore_to_torch" else src).state_dict()
    theirs = ref.state_dict()
    assert {k: list(v) for k, v in mine["state"].items()} == \
        {k: list(v) for k, v in theirs["state"].items()}
    strip = lambda g: [k for k in g if k != "formula"]  # noqa: E731  (AdamW's own key)
    assert [strip(g) for g in mine["param_groups"]] == [strip(g) for g in theirs["param_groups"]]


def test_pickle_and_deepcopy_keep_state():
    p = torch.nn.Parameter(torch.randn(50))
    o = st.SGD([p], lr=1e-2, momentum=0.9, isa=ISAS[0], threads=1)
    p.grad = torch.randn(50)
    o.step()
    for clone in (copy.deepcopy(o), pickle.loads(pickle.dumps(o))):
        assert clone.engine.isa == ISAS[0] and clone.engine.threads == 1
        q = clone.param_groups[0]["params"][0]
        assert_bits(clone.state[q]["momentum_buffer"], o.state[p]["momentum_buffer"], "copied")
        q.grad = p.grad.clone()
        r = torch.optim.SGD([torch.nn.Parameter(q.detach().clone())], lr=1e-2, momentum=0.9,
                            fused=True)
        r.load_state_dict(copy.deepcopy(clone.state_dict()))
        r.param_groups[0]["params"][0].grad = p.grad.clone()
        clone.step()
        r.step()
        assert_bits(q, r.param_groups[0]["params"][0], "continued after copy")


# ---- AMP, hooks, zero_grad -------------------------------------------------------------


@pytest.mark.parametrize("name,opts", [("Adam", dict(amsgrad=True)), ("AdamW", {}),
                                       ("SGD", dict(momentum=0.9)), ("Adagrad", {})])
def test_grad_scaler_with_an_overflowing_step(name, opts):
    """torch.amp.GradScaler drives the drop-in exactly as torch's fused optimizer."""
    ours_cls, torch_cls, _ = PAIRS[name]
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))
    twin = copy.deepcopy(model)
    o = ours_cls(model.parameters(), lr=1e-2, **opts)
    r = torch_cls(twin.parameters(), lr=1e-2, fused=True, **opts)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    x = torch.randn(32, 9)
    for k in range(5):
        for m, opt, sc in ((model, o, scalers[0]), (twin, r, scalers[1])):
            opt.zero_grad()
            loss = m(x).square().mean()
            if k == 2:
                loss = loss * float("inf")  # an overflow: both skip the step
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        for a, b in zip(model.parameters(), twin.parameters()):
            assert_bits(a, b, f"GradScaler step {k}")
            assert list(o.state[a]) == list(r.state[b])
            for key, value in r.state[b].items():
                assert_bits(o.state[a][key], value, f"step {k} {key}")


@pytest.mark.parametrize("name", list(PAIRS) + ["SignSGD"])
def test_torch_optimizer_hooks_and_zero_grad(name):
    cls = st.SignSGD if name == "SignSGD" else PAIRS[name][0]
    p = torch.nn.Parameter(torch.randn(5))
    o = cls([p], lr=1e-2)
    calls = []
    o.register_step_pre_hook(lambda opt, args, kw: calls.append(("pre", opt is o)))
    o.register_step_post_hook(lambda opt, args, kw: calls.append(("post", opt is o)))
    o.register_state_dict_pre_hook(lambda opt: calls.append(("sd_pre", opt is o)))

    def sd_post(opt, sd):
        sd["extra"] = 1
        return sd
    o.register_state_dict_post_hook(sd_post)
    o.register_load_state_dict_pre_hook(lambda opt, sd: calls.append(("load_pre", "extra" in sd)))
    o.register_load_state_dict_post_hook(lambda opt: calls.append(("load_post", opt is o)))
    p.grad = torch.randn(5)
    before = p.detach().clone()
    o.step()
    assert calls == [("pre", True), ("post", True)]
    assert not torch.equal(p.detach(), before)
    sd = o.state_dict()
    assert sd["extra"] == 1
    o.load_state_dict(sd)
    assert calls[2:] == [("sd_pre", True), ("load_pre", True), ("load_post", True)]
    o.zero_grad()
    assert p.grad is None
    after = p.detach().clone()
    o.step()  # no grads: nothing changes
    assert_bits(p, after, "step without grads")
    p.grad = torch.ones(5)
    o.zero_grad(set_to_none=False)
    assert p.grad is not None and not p.grad.any()


def test_closure_and_two_groups_with_scheduler_on_momentum_toggle():
    """A group's momentum turned on mid-run starts its buffers then (torch: first step)."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, generator=gen)
    p, q = torch.nn.Parameter(x.clone()), torch.nn.Parameter(x.clone())
    o = st.SGD([p], lr=0.1)
    r = torch.optim.SGD([q], lr=0.1, fused=True)
    for k in range(4):
        if k == 2:
            o.param_groups[0]["momentum"] = r.param_groups[0]["momentum"] = 0.9
        g = make_grad(9, gen)
        p.grad, q.grad = g.clone(), g.clone()
        assert o.step(lambda: 1.5) == 1.5
        r.step()
        assert_bits(p, q, f"step {k}")


# ---- constructors, param_groups keys, bad arguments --------------------------------------


@pytest.mark.parametrize("name", list(PAIRS))
def test_signature_and_group_keys_are_torchs(name):
    ours_cls, torch_cls, extra = PAIRS[name]
    theirs = inspect.signature(torch_cls.__init__).parameters
    mine = {k: v for k, v in inspect.signature(ours_cls.__init__).parameters.items()
            if k not in extra}
    assert list(mine) == list(theirs)
    for k, v in theirs.items():
        assert (mine[k].kind, mine[k].default) == (v.kind, v.default), k
    o = ours_cls([torch.nn.Parameter(torch.zeros(2))])
    r = torch_cls([torch.nn.Parameter(torch.zeros(2))], fused=True)
    keys = [k for k in o.param_groups[0] if k != "formula"]
    assert keys == list(r.param_groups[0])
    for k in keys:
        if k != "params":
            assert o.param_groups[0][k] == r.param_groups[0][k], k
    assert o._step_supports_amp_scaling


REFUSED_BY_TORCH = {
    "Adam": [dict(lr=-1.0), dict(lr=float("nan")), dict(eps=-1.0), dict(betas=(1.0, 0.9)),
             dict(betas=(0.9, 1.5)), dict(weight_decay=-1e-3),
             dict(betas=(0.9, torch.tensor(0.999))), dict(betas=(torch.tensor(0.9), 0.999)),
             dict(betas=(0, 0.999)), dict(lr=torch.tensor([1e-3, 1e-3])),
             dict(lr=torch.tensor(1e-3), foreach=True),
             dict(fused=True, foreach=True), dict(fused=True, differentiable=True)],
    "SGD": [dict(lr=-0.1), dict(momentum=-0.5), dict(weight_decay=-1.0), dict(nesterov=True),
            dict(nesterov=True, momentum=0.9, dampening=0.1), dict(lr=torch.tensor([0.1, 0.2])),
            dict(fused=True, foreach=True), dict(fused=True, differentiable=True)],
    "Adagrad": [dict(lr=-1.0), dict(lr_decay=-1.0), dict(weight_decay=-1.0),
                dict(initial_accumulator_value=-1.0), dict(eps=-1.0),
                dict(lr=torch.tensor([0.1, 0.2])), dict(fused=True, foreach=True),
                dict(fused=True, differentiable=True)],
}
REFUSED_BY_TORCH["AdamW"] = REFUSED_BY_TORCH["Adam"]


@pytest.mark.parametrize("name,kwargs", [(n, k) for n, ks in REFUSED_BY_TORCH.items()
                                         for k in ks])
def test_arguments_torch_refuses_raise_torchs_exception(name, kwargs):
    ours_cls, torch_cls, _ = PAIRS[name]
    assert_raises_like_torch(ours_cls, torch_cls, [torch.nn.Parameter(torch.zeros(2))], **kwargs)
    if "fused" not in kwargs:  # as torch's fused optimizer refuses them too
        assert_raises_like_torch(ours_cls, torch_cls, [torch.nn.Parameter(torch.zeros(2))],
                                 fused=True, **kwargs)


@pytest.mark.parametrize("name,kwargs,option", [
    (n, k, o) for n in PAIRS for k, o in ((dict(fused=False), "fused"),
                                           (dict(differentiable=True), "differentiable"))]
    + [(n, dict(capturable=True), "capturable") for n in ("Adam", "AdamW")])
def test_options_stepcore_does_not_compute_are_refused(name, kwargs, option):
    ours_cls, torch_cls, _ = PAIRS[name]
    torch_cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)  # torch takes it (not fused)
    with pytest.raises(NotImplementedError, match=option):
        ours_cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize("name,kwargs,key", [
    ("Adam", dict(eps=0.0), "eps"), ("Adam", dict(lr=float("inf")), "lr"),
    ("SGD", dict(lr=float("nan")), "lr"), ("SGD", dict(dampening=1.5, momentum=0.9), "dampening"),
    ("Adagrad", dict(lr_decay=float("inf")), "lr_decay"),
    ("Adagrad", dict(eps=1e39), "eps")])
def test_values_torch_takes_but_stepcore_bounds_refuse(name, kwargs, key):
    """docs/numerics.md 9: stricter than torch where a value cannot give finite f32 bits."""
    ours_cls, torch_cls, _ = PAIRS[name]
    torch_cls([torch.nn.Parameter(torch.zeros(2))], fused=True, **kwargs)
    with pytest.raises(ValueError, match=f"param_groups\\[0\\].*'{key}'"):
        ours_cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize("name", list(PAIRS) + ["Lion", "SignSGD"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float8_e4m3fn])
def test_param_dtypes_other_than_f32_bf16_f16_are_not_supported(name, dtype):
    ours_cls = PAIRS[name][0] if name in PAIRS else getattr(st, name)
    match = "compute in float32" if dtype == torch.float64 else "float32, bfloat16 and float16"
    with pytest.raises(NotImplementedError, match=f"'params'\\]\\[0\\]' has dtype {dtype}.*{match}"):
        ours_cls([torch.nn.Parameter(torch.zeros(2, dtype=dtype))])
    o = ours_cls([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(NotImplementedError, match=str(dtype)):
        o.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=dtype))]})
    assert len(o.param_groups) == 1


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
@pytest.mark.parametrize("name", list(PAIRS))
def test_sparse_grads_are_refused_like_torch(name):
    """torch's fused optimizers raise RuntimeError; stepcore's NotImplementedError is one."""
    ours_cls, torch_cls, _ = PAIRS[name]
    for cls, kw in ((ours_cls, {}), (torch_cls, dict(fused=True))):
        p = torch.nn.Parameter(torch.zeros(3))
        o = cls([p], **kw)
        p.grad = torch.sparse_coo_tensor([[0]], [1.0], (3,))
        with pytest.raises(RuntimeError, match="sparse"):
            o.step()


@pytest.mark.parametrize("name,opts", [("Adam", dict(amsgrad=True)),
                                       ("SGD", dict(momentum=0.9)), ("Adagrad", {})])
def test_bad_state_names_it_and_changes_nothing(name, opts):
    gen = torch.Generator().manual_seed(9)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (33, 12)]
    o = PAIRS[name][0]([{"params": ps[:1]}, {"params": ps[1:]}], lr=1e-2, **opts)
    for _ in range(2):
        apply(ps, grads_for(ps, gen))
        o.step()
    key = list(o.state[ps[1]])[-1]  # max_exp_avg_sq, momentum_buffer, sum
    o.state[ps[1]][key] = torch.zeros(24)[::2]
    tensors = [t for p in ps for t in (p, p.grad, *o.state[p].values())]
    before = fingerprint(tensors)
    where = r"param_groups\[1\]\['params'\]\[0\]"
    with pytest.raises(ValueError, match=rf"{where}.*{key}.*contiguous"):
        o.step()
    assert fingerprint(tensors) == before


# ---- Engine.step: the generic binding ----------------------------------------------------


def test_optimizers_lists_every_engine_optimizer_with_its_keys():
    opts = stepcore.optimizers()
    assert list(opts) == ["adamw", "sign_sgd", "adam", "sgd", "adagrad", "lion"]
    assert list(opts["sgd"]) == ["lr", "momentum", "dampening", "weight_decay", "nesterov",
                                 "maximize", "torch_tail_width"]
    assert opts["adagrad"]["eps"] == 1e-10 and opts["adamw"]["formula"] == "torch"


def test_engine_step_parses_name_and_hyper_before_writing():
    e = stepcore.Engine(threads=1)
    p, g = np.ones(5, np.float32), np.ones(5, np.float32)
    b, s = np.zeros(5, np.float32), np.zeros((), np.float32)
    snapshot = [x.copy() for x in (p, b, s)]
    steps = [s]
    cases = [("sgd", dict(lr=0.1, foo=1.0), ValueError, r"'foo'.*optimizer 'sgd'.*its keys: lr"),
             ("sgd", dict(lr="0.1"), TypeError, r"'lr'.*expected a float.*str"),
             ("sgd", dict(nesterov=1), TypeError, r"'nesterov'.*expected a bool"),
             ("sgd", dict(torch_tail_width=2**40), ValueError, r"'torch_tail_width'"),
             ("adamw", dict(formula="fast"), ValueError, r"'formula'"),
             ("sgdm", dict(), ValueError, r"'optimizer'.*'sgdm'.*adamw, sign_sgd, adam, sgd"),
             ("sgd", dict(lr=-1.0, momentum=0.9), ValueError, r"'lr'"),
             ("sgd", dict(momentum=0.9), ValueError, r"'steps\[0\]'")]
    for name, hyper, err, match in cases:
        with pytest.raises(err, match=match):
            e.step(name, [p], [[b]], None if match.startswith("'steps") else steps, [g],
                   hyper=hyper)
        for x, y in zip((p, b, s), snapshot):
            assert np.array_equal(x, y), (name, hyper)
    with pytest.raises(ValueError, match=r"'states\[1\]'.*2 entries for 1"):
        e.step("adam", [p], [[b], [b, b]], [s], [g])
    with pytest.raises(ValueError, match=r"'states'.*4 state lists"):
        e.step("adam", [p], [[b]] * 4, [s], [g])


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "adagrad"])
def test_engine_step_equals_torch_fused_kernel(name):
    """Engine.step on numpy arrays, the optimizer by name, equals torch's fused optimizer."""
    gen = torch.Generator().manual_seed(12)
    sizes = [1, 9, 1025]
    init = [torch.randn(n, generator=gen) for n in sizes]
    refs = [torch.nn.Parameter(x.clone()) for x in init]
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
           "adagrad": torch.optim.Adagrad}[name]
    hyper = {"adam": dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
             "adamw": dict(lr=1e-2, weight_decay=0.1, maximize=True),
             "sgd": dict(lr=0.1, momentum=0.9, nesterov=True),
             "adagrad": dict(lr=0.1, lr_decay=0.01)}[name]
    r = cls(refs, fused=True, **hyper)
    params = [x.numpy().copy() for x in init]
    nslots = {"adam": 3, "adamw": 2, "sgd": 1, "adagrad": 1}[name]
    states = [[np.zeros(n, np.float32) for n in sizes] for _ in range(nslots)]
    steps = [np.zeros((), np.float32) for _ in sizes]
    e = stepcore.Engine()
    for k in range(4):
        gs = grads_for(refs, gen)
        apply(refs, gs)
        r.step()
        e.step(name, params, states, steps, [g.numpy() for g in gs], hyper=hyper)
        for i, q in enumerate(refs):
            assert_bits(torch.from_numpy(params[i]), q.detach(), f"{name} step {k} param {i}")
            assert float(steps[i]) == k + 1
    e.step(name, params, states, steps, [g.numpy() for g in gs], hyper=hyper, found_inf=True)
    assert all(float(s) == 4 for s in steps)


def test_engine_step_sign_sgd_equals_the_formula():
    gen = torch.Generator().manual_seed(13)
    p = make_grad(1025, gen)
    g = make_grad(1025, gen)
    want = sign_sgd_expected(p, g, 0.37, 0.1)
    got = p.numpy().copy()
    stepcore.Engine().step("sign_sgd", [got], [], None, [g.numpy()],
                           hyper=dict(lr=0.37, weight_decay=0.1))
    assert_bits(torch.from_numpy(got), want, "sign_sgd")
    assert math.isfinite(float(got[0]))


@pytest.mark.parametrize("name,opts", [("Adam", dict(amsgrad=True, weight_decay=0.1)),
                                       ("SGD", dict(momentum=0.9)), ("Adagrad", {})])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_precision_grads_read_exactly(name, opts, grad_dtype):
    """bf16/f16 grads of f32 params are read as f32(g): torch fused given g.float()."""
    ours_cls, torch_cls, _ = PAIRS[name]
    gen = torch.Generator().manual_seed(14)
    init = [torch.randn(n, generator=gen) for n in (7, 1025)]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    for p in ours:
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None  # torch >= 2.10: a grad of another dtype may be assigned
    o = ours_cls(ours, lr=1e-2, **opts)
    r = torch_cls(ref, lr=1e-2, fused=True, **opts)
    for k in range(3):
        for p, q in zip(ours, ref):
            g = (make_grad(p.numel(), gen) * 1e-2).to(grad_dtype)
            p.grad, q.grad = g.clone(), g.float()
        o.step()
        r.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            assert_bits(p, q, f"{grad_dtype} grads step {k} param {i}")


@pytest.mark.parametrize("option", ["amsgrad", "maximize"])
def test_adamw_native_formula_has_no_amsgrad_or_maximize(option):
    with pytest.raises(ValueError, match=rf"param_groups\[0\].*'{option}'.*torch formula"):
        st.AdamW([torch.nn.Parameter(torch.zeros(2))], formula="native", **{option: True})
