"""stepcore.torch's 8-bit drop-ins (AdamW8bit, Adam8bit): one per optimizer whose table
entry takes 8-bit state; equal to stepcore.reference_step on the same (codes, absmax)
pairs, and by default to torchao.optim.AdamW8bit bit for bit; state_dict both ways and
torchao's state_dict imported mid-run; bad arguments refused naming them."""

import copy
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import stepcore  # noqa: E402
import stepcore.torch as st  # noqa: E402

BLOCK = stepcore.Q8_BLOCK_SIZE


def bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else
                  torch.uint8 if t.element_size() == 1 else torch.int32)


def assert_same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), what


def test_the_eight_bit_classes_follow_the_table():
    table = stepcore.optimizer_table()
    for e in table:
        name = e["name"]
        if e["q8"]:
            cls = st.optimizer_class(name, q8=True)
            assert cls.__name__ == st.optimizer_class(name).__name__ + "8bit"
            assert getattr(st, cls.__name__) is cls and cls.__name__ in st.__all__
        else:
            with pytest.raises(NotImplementedError, match=name):
                st.optimizer_class(name, q8=True)
    assert st.AdamW8bit is st.optimizer_class("adamw", q8=True)
    assert st.Adam8bit is st.optimizer_class("adam", q8=True)
    assert st.optimizer_class("adamw") is st.AdamW


def model_params(dtype=torch.float32, seed=0):
    """8-bit sized (>= 4096, some not a multiple of the block) and f32-sized params."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(32, 256), (300,), (16, 257), (4096,), (1,), (0,)]
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes]


def set_grads(params, step, seed=1, zero_every=11):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    for p in params:
        x = torch.randn(p.shape, generator=g) * 10.0 ** (step % 7 - 3)
        x.view(-1)[::zero_every] = 0.0
        p.grad = x.to(p.dtype)


def run_steps(steps, *runs):
    """Steps each (params, optimizer) run at the given step numbers, the same gradients."""
    for s in steps:
        for params, opt in runs:
            set_grads(params, s)
            opt.step()


def reference_run(params, steps, optimizer, hyper, min_8bit_size=4096, grad_scale=1.0):
    """The same steps through stepcore.reference_step on numpy copies: 8-bit pairs for
    params of at least min_8bit_size elements (codes 0, maxima 0), zeros otherwise."""
    slots = stepcore.optimizer_slots(optimizer, hyper)
    ps = [p.detach().clone() for p in params]
    states = [[(np.zeros(p.numel(), np.uint8), np.zeros((p.numel() + BLOCK - 1) // BLOCK,
                                                            np.float32))
               if p.numel() >= min_8bit_size else torch.zeros(p.numel(), dtype=p.dtype)
               for p in params] for _ in slots]
    counters = [np.zeros((), np.float32) for _ in params]
    for s in range(steps):
        set_grads(ps, s)
        grads = [p.grad.reshape(-1) for p in ps]
        stepcore.reference_step(optimizer, [p.data.reshape(-1) for p in ps], states, counters,
                                grads, hyper=hyper, grad_scale=grad_scale)
    return ps, states


@pytest.mark.parametrize("cls,kwargs,optimizer,hyper", [
    ("AdamW8bit", {"formula": "torch", "weight_decay": 0.01}, "adamw",
     {"formula": "torch", "weight_decay": 0.01}),
    ("AdamW8bit", {"formula": "native", "weight_decay": 0.1}, "adamw",
     {"formula": "native", "weight_decay": 0.1}),
    ("AdamW8bit", {"amsgrad": True, "weight_decay": 0.01}, "adamw",
     {"formula": "torchao", "amsgrad": True, "weight_decay": 0.01}),
    ("Adam8bit", {"weight_decay": 0.05}, "adam", {"formula": "torchao", "weight_decay": 0.05}),
    ("Adam8bit", {"formula": "torch", "amsgrad": True, "weight_decay": 0.05}, "adam",
     {"formula": "torch", "amsgrad": True, "weight_decay": 0.05}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_step_equals_the_reference(cls, kwargs, optimizer, hyper, dtype):
    params = model_params(dtype)
    want_p, want_states = reference_run(params, 6, optimizer, dict(hyper, lr=2e-3), 4096)
    opt = getattr(st, cls)(params, lr=2e-3, threads=3, **kwargs)
    for s in range(6):
        set_grads(params, s)
        opt.step()
    keys = stepcore.optimizer_slots(optimizer, hyper)
    for i, p in enumerate(params):
        assert_same(p.detach().reshape(-1), want_p[i].detach().reshape(-1), f"param {i}")
        state = opt.state[p]
        for k, key in enumerate(keys):
            want = want_states[k][i]
            if isinstance(want, tuple):
                assert state[key].dtype == torch.uint8, (i, key)
                assert_same(state[key].reshape(-1), torch.from_numpy(want[0]), f"{key} {i}")
                assert_same(state[key + "_absmax"], torch.from_numpy(want[1]), f"{key} max {i}")
            else:
                assert_same(state[key].reshape(-1), want, f"{key} {i} (f32 state)")


def test_grad_scale_and_found_inf_as_the_fused_optimizers():
    params = model_params()
    want_p, _ = reference_run(params, 3, "adamw",
                              {"formula": "torchao", "lr": 1e-3, "weight_decay": 0.01},
                              grad_scale=0.25)  # g / 4 == g * 0.25 exactly
    opt = st.AdamW8bit(params, lr=1e-3)
    for s in range(3):
        set_grads(params, s)
        before = [p.detach().clone() for p in params]
        opt.step(grad_scale=torch.tensor(4.0), found_inf=torch.tensor(1.0))  # skipped
        for p, b in zip(params, before):
            assert_same(p, b, "a found-inf step changes nothing")
        opt.step(grad_scale=torch.tensor(4.0), found_inf=torch.tensor(0.0))
    for p, w in zip(params, want_p):
        assert_same(p.detach(), w.detach(), "scaled steps")


def test_zero_gradient_coordinates_stay_exactly_put():
    for cls, kw in ((st.AdamW8bit, {}), (st.AdamW8bit, {"formula": "torch"}), (st.Adam8bit, {})):
        p = torch.nn.Parameter(torch.randn(8192))
        start = p.detach().clone()
        opt = cls([p], lr=1e-3, weight_decay=0.0, **kw)
        g = torch.Generator().manual_seed(3)
        for _ in range(60):
            grad = torch.randn(8192, generator=g)
            grad[::5] = 0.0
            p.grad = grad
            opt.step()
        assert_same(p.detach()[::5], start[::5], f"{cls.__name__} {kw}")
        assert not torch.equal(p.detach()[1::5], start[1::5])


@pytest.mark.parametrize("cls", ["AdamW8bit", "Adam8bit"])
def test_default_equals_torchaos_with_groups_and_a_schedule(cls):
    tao = pytest.importorskip("torchao.optim")
    g = torch.Generator().manual_seed(7)
    # torchao quantizes params of >= 4096 elements that are a multiple of its block;
    # the others keep f32 state (as stepcore's below min_8bit_size).
    shapes = [(32, 256), (300,), (8192,), (17, 3)]
    init = [torch.randn(s, generator=g) for s in shapes]
    mine = [torch.nn.Parameter(x.clone()) for x in init]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]

    def groups(ps):
        return [{"params": ps[:2], "lr": 3e-3}, {"params": ps[2:], "weight_decay": 0.2}]

    a = getattr(st, cls)(groups(mine), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.05)
    b = getattr(tao, cls)(groups(theirs), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.05)
    sa = torch.optim.lr_scheduler.StepLR(a, step_size=3, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(b, step_size=3, gamma=0.5)
    for s in range(8):
        set_grads(mine, s)
        set_grads(theirs, s)
        a.step()
        b.step()
        sa.step()
        sb.step()
        for i, (x, y) in enumerate(zip(mine, theirs)):
            assert_same(x.detach(), y.detach(), f"param {i}, step {s}")
    for x, y in zip(mine, theirs):
        for key in ("exp_avg", "exp_avg_sq"):
            theirs_state = b.state[y][key]
            if hasattr(theirs_state, "codes"):
                assert_same(a.state[x][key], theirs_state.codes, key)
                assert_same(a.state[x][key + "_absmax"], theirs_state.scale, key)
            else:
                assert_same(a.state[x][key], theirs_state, key)


def test_state_dict_round_trips_and_torchaos_loads_mid_run():
    for dtype in (torch.float32, torch.bfloat16):
        params = model_params(dtype)
        opt = st.AdamW8bit(params, lr=1e-3)
        run_steps(range(3), (params, opt))
        saved = copy.deepcopy(opt.state_dict())  # torch's state_dict shares the tensors
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        loaded = st.AdamW8bit(copies, lr=1e-3)
        loaded.load_state_dict(saved)
        run_steps(range(3, 6), (params, opt), (copies, loaded))
        for p, q in zip(params, copies):
            assert_same(p.detach(), q.detach(), f"resumed run ({dtype})")
            for key, v in opt.state[p].items():
                assert_same(loaded.state[q][key], v, f"{key} ({dtype})")
    tao = pytest.importorskip("torchao.optim")
    init = [torch.randn(4096 * 2), torch.randn(100)]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]
    b = tao.AdamW8bit(theirs, lr=2e-3)
    run_steps(range(3), (theirs, b))
    moved = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    a = st.AdamW8bit(moved, lr=2e-3)
    a.load_state_dict(through_a_file(b.state_dict()))
    assert a.state[moved[0]]["exp_avg"].dtype == torch.uint8
    for s in range(3, 7):
        run_steps([s], (theirs, b), (moved, a))
        for x, y in zip(moved, theirs):
            assert_same(x.detach(), y.detach(), f"after torchao's state_dict, step {s}")


def through_a_file(state_dict):
    """state_dict saved by torch.save and loaded back (torchao's state cannot be deep-copied)."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_bad_arguments_and_state_are_refused_naming_them():
    p = torch.nn.Parameter(torch.randn(5000))
    for kwargs, name in (({"block_size": 128}, "block_size"), ({"block_size": "256"}, "block_size"),
                         ({"min_8bit_size": -1}, "min_8bit_size"),
                         ({"min_8bit_size": 4096.0}, "min_8bit_size")):
        with pytest.raises(ValueError, match=name):
            st.AdamW8bit([p], **kwargs)
    opt = st.AdamW8bit([p], lr=1e-3)
    p.grad = torch.randn(5000)
    opt.step()
    before = p.detach().clone()
    state = opt.state[p]
    spoiled = [
        ("exp_avg_absmax", state["exp_avg_absmax"][:-1].clone(), ValueError),
        ("exp_avg_sq_absmax", state["exp_avg_sq_absmax"].double(), TypeError),
        ("exp_avg", state["exp_avg"][:-1].clone(), ValueError),
    ]
    for key, value, error in spoiled:
        good = state[key]
        state[key] = value
        with pytest.raises(error, match=key):
            opt.step()
        state[key] = good
        assert_same(p.detach(), before, f"nothing written ({key})")
    del state["exp_avg_absmax"]
    with pytest.raises(ValueError, match="exp_avg_absmax"):
        opt.step()
    assert_same(p.detach(), before, "nothing written (no maxima)")


def test_a_torchao_state_of_another_block_or_map_is_refused():
    tao = pytest.importorskip("torchao.optim")
    theirs = torch.nn.Parameter(torch.randn(8192))
    b = tao.AdamW8bit([theirs], lr=1e-3, block_size=128)
    theirs.grad = torch.randn(8192)
    b.step()
    a = st.AdamW8bit([torch.nn.Parameter(theirs.detach().clone())])
    with pytest.raises(ValueError, match=r"\['exp_avg'\].*blocks of 256"):
        a.load_state_dict(b.state_dict())
    b = tao.AdamW8bit([theirs], lr=1e-3)
    b.step()
    saved = b.state_dict()
    saved["state"][0]["exp_avg_sq"].qmap[3] = 0.5  # not stepcore's unsigned map
    with pytest.raises(ValueError, match="exp_avg_sq.*map"):
        a.load_state_dict(saved)


def test_a_bitsandbytes_state_dict_loads_and_steps_as_the_reference():
    """bitsandbytes' AdamW8bit state (state1/absmax1 exp_avg, state2/absmax2 exp_avg_sq,
    the same maps and blocks; f32 state for small params) becomes AdamW8bit's state as it
    is, and the next step equals stepcore.reference_step from that state."""
    bnb = pytest.importorskip("bitsandbytes")
    theirs = [torch.nn.Parameter(torch.randn(8192 + 300)), torch.nn.Parameter(torch.randn(100))]
    b = bnb.optim.AdamW8bit(theirs, lr=1e-3, weight_decay=0.0)
    run_steps(range(3), (theirs, b))
    moved = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    a = st.AdamW8bit(moved, lr=1e-3, weight_decay=0.0, formula="torch")
    a.load_state_dict(through_a_file(b.state_dict()))
    big, small = a.state[moved[0]], a.state[moved[1]]
    sb = b.state[theirs[0]]
    for k, n in (("exp_avg", 1), ("exp_avg_sq", 2)):
        assert_same(big[k], sb[f"state{n}"], k)
        assert_same(big[k + "_absmax"], sb[f"absmax{n}"], k)
        assert_same(small[k], b.state[theirs[1]][f"state{n}"], k + " (f32)")
    assert float(big["step"]) == 3.0 and float(small["step"]) == 3.0
    # The next step, from the imported state, against the reference on copies of it.
    params = [p.detach().clone().reshape(-1) for p in moved]
    states = [[(big[k].clone().reshape(-1).numpy(), big[k + "_absmax"].clone().numpy()),
               small[k].clone()] for k in ("exp_avg", "exp_avg_sq")]
    steps = [np.full((), 3.0, np.float32), np.full((), 3.0, np.float32)]
    set_grads(moved, 3)
    grads = [p.grad.reshape(-1).clone() for p in moved]
    stepcore.reference_step("adamw", params, states, steps, grads,
                            hyper={"lr": 1e-3, "weight_decay": 0.0, "formula": "torch"})
    a.step()
    for p, w in zip(moved, params):
        assert_same(p.detach().reshape(-1), w, "the step after the import")
    saved = b.state_dict()
    saved["state"][0]["__bnb_optimizer_quant_state__"]["qmap2"][7] += 1e-3
    with pytest.raises(ValueError, match="state2.*map"):
        st.AdamW8bit(moved).load_state_dict(saved)
