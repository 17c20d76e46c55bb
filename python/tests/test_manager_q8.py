"""stepcore.torch.GradientManager with 8-bit state (optimizer="adamw8bit", "adam8bit") in
every offload mode, against torchao's AdamW8bit and Adam8bit on the CPU (pinned from PyPI;
each equal to stepcore.torch's class of that name bit for bit, test_torch_q8.py) after every
step: params, codes and block maxima, with groups, overlap and clip_grad_norm_; the
state_dict resumes in another manager and moves to the drop-in; a checkpoint file resumes;
bad arguments are refused naming them.
"""

import pytest

torch = pytest.importorskip("torch", reason="stepcore.torch tests need PyTorch")

import stepcore.torch as st  # noqa: E402

# torchao quantizes params of >= 4096 elements that are a multiple of its block of 256;
# the others keep f32 state (as stepcore's below min_8bit_size).
SHAPES = [(32, 256), (300,), (8192,), (17, 3), (40, 128)]
LR, BETAS, WD = 1e-3, (0.9, 0.95), 0.05


def initial():
    g = torch.Generator().manual_seed(11)
    return [torch.randn(s, generator=g) for s in SHAPES]


def grad_at(i, step, shape):
    g = torch.Generator().manual_seed(1000 * step + i)
    x = torch.randn(shape, generator=g)
    x.view(-1)[:: 7] = 0.0  # coordinates without a gradient
    return x * (10.0 ** (i % 3 - 1))


def groups(ps):
    return [{"params": ps[:2], "lr": 3e-3}, {"params": ps[2:], "weight_decay": 0.2}]


def manager(params, offload="full", optimizer="adamw8bit", **kw):
    return st.GradientManager(groups(params), offload=offload, optimizer=optimizer, lr=LR,
                              betas=BETAS, weight_decay=WD, threads=2, **kw)


def manager_step(gm, params, step, overlap=False, max_norm=None):
    """One step: d(sum(p * G))/dp = G exactly, handed over by the manager's hooks."""
    gm.begin_step(1.0, overlap_optimizer=overlap)
    gm.begin_backward(final_backward=True)
    loss = sum((p * grad_at(i, step, p.shape)).sum() for i, p in enumerate(params))
    loss.backward()
    gm.finish_backward()
    if max_norm is not None:
        gm.clip_grad_norm_(max_norm)
    gm.step()
    return gm.report()


def torchao_step(opt, params, step):
    for i, p in enumerate(params):
        p.grad = grad_at(i, step, p.shape)
    opt.step()
    opt.zero_grad(set_to_none=True)


def assert_same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def torchao_state(opt, p, key):
    """torchao's state `key` of p as (codes, maxima), or the f32 tensor."""
    v = opt.state[p][key]
    return (v.codes, v.scale) if hasattr(v, "codes") else v


@pytest.mark.parametrize("optimizer,cls", [("adamw8bit", "AdamW8bit"), ("adam8bit", "Adam8bit")])
@pytest.mark.parametrize("offload", ["none", "optimizer", "full"])
@pytest.mark.parametrize("overlap", [False, True])
def test_equals_torchao_after_every_step(optimizer, cls, offload, overlap):
    tao = pytest.importorskip("torchao.optim")
    init = initial()
    mine = [torch.nn.Parameter(x.clone()) for x in init]
    theirs = [torch.nn.Parameter(x.clone()) for x in init]
    gm = manager(mine, offload, optimizer)
    ref = getattr(tao, cls)(groups(theirs), lr=LR, betas=BETAS, weight_decay=WD)
    try:
        assert [gm._m.q8_parameter(i) for i in range(len(SHAPES))] == \
            [True, False, True, False, True]
        for s in range(6):
            # A max_norm above every step's norm: clip_grad_norm_ runs, the coefficient is 1.
            rep = manager_step(gm, mine, s, overlap=overlap, max_norm=1e9 if s % 2 else None)
            torchao_step(ref, theirs, s)
            assert rep["stepped"]
            for i, (x, y) in enumerate(zip(mine, theirs)):
                assert_same(x.detach(), y.detach(), f"param {i}, step {s}")
        sd = gm.state_dict()["state"]
        for i, y in enumerate(theirs):
            for key in ("exp_avg", "exp_avg_sq"):
                want = torchao_state(ref, y, key)
                if isinstance(want, tuple):
                    assert_same(sd[i][key], want[0], f"{key} codes of param {i}")
                    assert_same(sd[i][key + "_absmax"], want[1], f"{key} maxima of param {i}")
                else:
                    assert_same(sd[i][key], want, f"{key} of param {i}")
    finally:
        gm.close()


def test_state_dict_resumes_in_a_new_manager_and_moves_to_the_drop_in():
    init = initial()
    params = [torch.nn.Parameter(x.clone()) for x in init]
    gm = manager(params)
    for s in range(3):
        manager_step(gm, params, s)
    saved = {"state": {i: {k: v.clone() for k, v in e.items()}
                       for i, e in gm.state_dict()["state"].items()},
             "param_groups": gm.state_dict()["param_groups"]}
    # A new manager from the saved state, and the drop-in from the same dict.
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    gm2 = manager(resumed)
    gm2.load_state_dict(saved)
    dropped = [torch.nn.Parameter(p.detach().clone()) for p in params]
    drop_in = st.AdamW8bit(groups(dropped), lr=LR, betas=BETAS, weight_decay=WD)
    drop_in.load_state_dict({"state": {i: {k: v for k, v in e.items() if k != "master"}
                                       for i, e in saved["state"].items()},
                             "param_groups": [dict(g, **{"block_size": 256,
                                                         "min_8bit_size": 4096})
                                              for g in drop_in.state_dict()["param_groups"]]})
    try:
        for s in range(3, 6):
            manager_step(gm, params, s)
            manager_step(gm2, resumed, s)
            torchao_step(drop_in, dropped, s)
            for i in range(len(params)):
                assert_same(resumed[i].detach(), params[i].detach(), f"resumed {i}, step {s}")
                assert_same(dropped[i].detach(), params[i].detach(), f"drop-in {i}, step {s}")
        a, b = gm.state_dict()["state"], gm2.state_dict()["state"]
        for i in a:
            for key in a[i]:
                assert_same(b[i][key], a[i][key], f"{key} of param {i}")
    finally:
        gm.close()
        gm2.close()


def test_a_fresh_state_dict_loads_as_zeros_and_a_missing_maximum_is_refused():
    init = initial()
    params = [torch.nn.Parameter(x.clone()) for x in init]
    gm = manager(params)
    try:
        gm.load_state_dict({"state": {}, "param_groups": gm.state_dict()["param_groups"]})
        sd = gm.state_dict()["state"]
        assert torch.all(sd[0]["exp_avg"] == 127) and torch.all(sd[0]["exp_avg_sq"] == 0)
        assert torch.all(sd[0]["exp_avg_absmax"] == 0)
        bad = {"state": {0: {"exp_avg": sd[0]["exp_avg"].clone()}},
               "param_groups": gm.state_dict()["param_groups"]}
        with pytest.raises(ValueError, match="exp_avg_absmax"):
            gm.load_state_dict(bad)
        broken = {k: v.clone() for k, v in sd[0].items()}
        broken["exp_avg_sq_absmax"][1] = -1.0
        with pytest.raises(Exception, match="exp_avg_sq.absmax"):
            gm.load_state_dict({"state": {0: broken},
                                "param_groups": gm.state_dict()["param_groups"]})
    finally:
        gm.close()


@pytest.mark.parametrize("kw,name", [({"optimizer": "sgd8bit"}, "optimizer"),
                                     ({"optimizer": "adamw8bit", "block_size": 128},
                                      "block_size"),
                                     ({"optimizer": "adamw8bit", "min_8bit_size": -1},
                                      "min_8bit_size")])
def test_bad_8bit_arguments_are_refused_naming_them(kw, name):
    with pytest.raises(ValueError, match=name):
        st.GradientManager([torch.nn.Parameter(torch.zeros(4096))], offload="full", **kw)


def test_a_checkpoint_file_resumes_with_another_thread_count(tmp_path):
    """The manager's checkpoint (format 3: codes and block maxima) resumes in a manager of
    another thread count and ring with the uninterrupted run's bits."""
    init = initial()
    params = [torch.nn.Parameter(x.clone()) for x in init]
    gm = manager(params)
    path = str(tmp_path / "q8.stepcore")
    for s in range(3):
        manager_step(gm, params, s)
    gm._m.save_checkpoint(path)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    gm2 = st.GradientManager(groups(resumed), offload="full", optimizer="adamw8bit", lr=LR,
                             betas=BETAS, weight_decay=WD, threads=1, ring_slot_elements=300)
    gm2._m.load_checkpoint(path)
    try:
        for s in range(3, 6):
            manager_step(gm, params, s)
            manager_step(gm2, resumed, s)
            for i in range(len(params)):
                assert_same(resumed[i].detach(), params[i].detach(), f"param {i}, step {s}")
    finally:
        gm.close()
        gm2.close()
