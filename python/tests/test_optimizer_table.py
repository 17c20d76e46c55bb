"""Every optimizer of the table in every Python surface, against the scalar reference.

The optimizer table (``stepcore.optimizer_table()``, built from the C++ units) is the one
list: each test here is generated from it, so an optimizer added to the library is tested
here without an edit, and a surface that lacks it fails. The oracle is
``stepcore.reference_step`` (stepcore::reference, the literal definition) fed what plain
torch computes (autograd's accumulation, the exact norm in Python integers, torch's clip
formula), and torch's fused optimizer where torch has one; never a surface against itself.

* the table's binding: names, roles, kinds, defaults, slots; ``optimizers()`` from it;
* the drop-ins: ``stepcore.torch.optimizer_class(name)`` has one for every optimizer (an
  optimizer without one is named in a clear error), and each equals the reference (and
  torch's fused optimizer of the same name) bit for bit, f32 and bf16 params;
* ``stepcore.torch.GradientManager(optimizer=X)`` for every X, in every mode, with and
  without optimizer overlap, equals the reference after every step (params, every slot,
  step counters), clipped and unclipped steps alternating under an LR schedule; the betas
  argument reaching each optimizer by its role, and what the manager refuses.
"""

import re

import pytest

torch = pytest.importorskip("torch", reason="stepcore.torch tests need PyTorch")

import stepcore  # noqa: E402
import stepcore.torch as st  # noqa: E402
from exact import exact_norm  # noqa: E402
from test_torch_manager import (  # noqa: E402
    BETAS, MODES, WD, TinyLM, bits, drive, f32, loss_sum, make_groups, max_norm_at,
    micro_batches, schedule, tokens_of)

TABLE = stepcore.optimizer_table()
NAMES = [e["name"] for e in TABLE]
ENTRY = {e["name"]: e for e in TABLE}
ROLES = {"schedule", "betas", "fixed", "machine"}
KIND_TYPES = {"real": float, "flag": bool, "integer": int, "formula": str}


def raw(t):
    """The tensor's bit patterns: an int view of its bytes (int16 for bf16/f16)."""
    t = t.detach().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def has_betas(name):
    """Whether the optimizer has beta1 and beta2 (of either role)."""
    fields = {h["name"] for h in ENTRY[name]["hyper"]}
    return {"beta1", "beta2"} <= fields


# ---- the table ---------------------------------------------------------------------------


def test_the_table_lists_every_optimizer_with_its_fields_and_slots():
    """Distinct names, every field with a known role and kind and a default of its kind,
    lr and weight_decay each group's (role schedule), slot names distinct; optimizers()
    is the same table as {name: {field: default}}, and Engine.step takes every default."""
    assert len(set(NAMES)) == len(NAMES) and "lion" in NAMES
    assert stepcore.optimizers() == {
        e["name"]: {h["name"]: h["default"] for h in e["hyper"]} for e in TABLE}
    engine = stepcore.Engine(threads=1)
    for e in TABLE:
        names = [h["name"] for h in e["hyper"]]
        assert len(set(names)) == len(names), e["name"]
        for h in e["hyper"]:
            assert h["role"] in ROLES and type(h["default"]) is KIND_TYPES[h["kind"]], h
        schedule_fields = {h["name"] for h in e["hyper"] if h["role"] == "schedule"}
        assert schedule_fields == {"lr", "weight_decay"}, e["name"]
        slots = [s["name"] for s in e["slots"]]
        assert len(set(slots)) == len(slots), e["name"]
        for s in e["slots"]:
            assert s["initial"] is None or s["initial"] in names, s
        assert isinstance(e["counts_steps"], bool) and isinstance(e["reads_scaled"], bool)
        assert isinstance(e["q8"], bool)
        defaults = {h["name"]: h["default"] for h in e["hyper"]}
        engine.step(e["name"], [], [], None, [], hyper=defaults)  # validates, writes nothing
        # The slots one configuration uses are the first of the table's.
        used = stepcore.optimizer_slots(e["name"], defaults)
        assert used == slots[:len(used)], (e["name"], used, slots)


def test_optimizer_slots_follow_the_configuration():
    """optimizer_slots(name, hyper): the slots a configuration uses (e.g. amsgrad adds
    max_exp_avg_sq, momentum 0 keeps none); an unknown optimizer or key is named."""
    assert stepcore.optimizer_slots("adam") == ["exp_avg", "exp_avg_sq"]
    assert stepcore.optimizer_slots("adam", {"amsgrad": True})[-1] == "max_exp_avg_sq"
    assert stepcore.optimizer_slots("sgd") == []
    assert stepcore.optimizer_slots("sgd", {"momentum": 0.9}) == ["momentum_buffer"]
    with pytest.raises(ValueError, match="'optimizer'.*'muon'"):
        stepcore.optimizer_slots("muon")
    with pytest.raises(ValueError, match="'gamma'"):
        stepcore.optimizer_slots("lion", {"gamma": 1.0})


# ---- the drop-ins ----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_optimizer_of_the_table_has_a_drop_in(name):
    """optimizer_class(name) is a torch.optim.Optimizer of stepcore.torch that steps it."""
    cls = st.optimizer_class(name)
    assert issubclass(cls, torch.optim.Optimizer) and cls._UNIT == name
    assert cls.__name__ in st.__all__ and getattr(st, cls.__name__) is cls


def test_an_optimizer_without_a_drop_in_is_named(monkeypatch):
    """A name the table does not have: ValueError listing the table's names. An optimizer
    the table has but no drop-in steps (a unit added to the library first): a
    NotImplementedError naming it."""
    import stepcore._table as table

    with pytest.raises(ValueError, match=re.escape(
            "'optimizer' must be one of " + ", ".join(repr(n) for n in NAMES))):
        st.optimizer_class("muon")
    entry = dict(ENTRY["lion"], name="muon")
    monkeypatch.setattr(table, "_BY_NAME", dict(table._BY_NAME, muon=entry))
    monkeypatch.setattr(table, "NAMES", table.NAMES + ("muon",))
    with pytest.raises(NotImplementedError, match="optimizer 'muon'.*has no drop-in"):
        st.optimizer_class("muon")


def reference_state(name, h, params):
    """The reference's state of a fresh optimizer: its slots (zeros, or the value of the
    field the table names), its step counters (or None)."""
    e = ENTRY[name]
    starts = {s["name"]: s["initial"] for s in e["slots"]}
    defaults = {x["name"]: x["default"] for x in e["hyper"]}
    slots = []
    for slot in stepcore.optimizer_slots(name, h):
        start = starts[slot]
        value = 0.0 if start is None else h.get(start, defaults[start])
        slots.append([torch.full_like(p, value) for p in params])
    steps = ([torch.zeros((), dtype=torch.float32) for _ in params] if e["counts_steps"]
             else None)
    return slots, steps


SIZES = [1, 7, 8, 9, 16, 17, 33]
GROUP_HYPER = [dict(lr=1e-2, weight_decay=0.05), dict(lr=3e-3, weight_decay=0.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_every_drop_in_equals_the_reference(name, dtype):
    """The drop-in of every optimizer (two groups with their own lr and weight decay, the
    lr changed between steps, every other hyper-parameter at the constructor's default)
    equals the reference given the table's defaults: params, every state slot and step
    counter after each of 4 steps (so the drop-in's defaults are the table's too); and
    torch's fused optimizer of the same name, where torch has one."""
    cls = st.optimizer_class(name)
    gen = torch.Generator().manual_seed(NAMES.index(name))
    init = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
    split = [init[:4], init[4:]]

    def groups(ts):
        return [dict(params=g, **h) for g, h in zip(ts, GROUP_HYPER)]

    ours = [[torch.nn.Parameter(t.clone()) for t in g] for g in split]
    opt = cls(groups(ours), threads=2)
    torch_cls = getattr(torch.optim, cls.__name__, None)
    twin = None
    if torch_cls is not None:
        twin_params = [[torch.nn.Parameter(t.clone()) for t in g] for g in split]
        twin = (twin_params, torch_cls(groups(twin_params), fused=True))
    ref = [[t.clone() for t in g] for g in split]
    ref_state = [reference_state(name, h, g) for g, h in zip(ref, GROUP_HYPER)]
    for k in range(4):
        grads = [[(torch.randn(t.shape, generator=gen) * 1e-2).to(dtype) for t in g]
                 for g in split]
        lrs = [h["lr"] * (0.5 if k >= 2 else 1.0) for h in GROUP_HYPER]
        for gi, (group, g) in enumerate(zip(opt.param_groups, grads)):
            group["lr"] = lrs[gi]
            for p, x in zip(group["params"], g):
                p.grad = x.clone()
        opt.step()
        if twin is not None:
            for gi, (group, g) in enumerate(zip(twin[1].param_groups, grads)):
                group["lr"] = lrs[gi]
                for p, x in zip(group["params"], g):
                    p.grad = x.clone()
            twin[1].step()
        for gi, (params, g) in enumerate(zip(ref, grads)):
            h = dict(GROUP_HYPER[gi], lr=lrs[gi])
            slots, steps = ref_state[gi]
            stepcore.reference_step(name, params, slots, steps, g, hyper=h)
        for gi, (params, (slots, steps)) in enumerate(zip(ref, ref_state)):
            used = stepcore.optimizer_slots(name, GROUP_HYPER[gi])
            for i, (p, r) in enumerate(zip(ours[gi], params)):
                what = f"{name} {dtype} step {k} group {gi} param {i}"
                assert torch.equal(raw(p), raw(r)), what
                state = opt.state[p]
                for slot, values in zip(used, slots):
                    assert torch.equal(raw(state[slot]), raw(values[i])), f"{what} {slot}"
                if steps is not None and "step" in state:
                    assert float(state["step"]) == float(steps[i]), f"{what} step"
                if twin is not None:
                    q = twin[0][gi][i]
                    assert torch.equal(raw(p), raw(q)), f"{what} against torch"
                    for slot in used:
                        assert torch.equal(raw(state[slot]), raw(twin[1].state[q][slot])), \
                            f"{what} {slot} against torch"


# ---- GradientManager -------------------------------------------------------------------

STEPS = 2  # step 0 clips (max_norm_at), step 1 does not


def manager_betas(name):
    """The betas the manager runs with: BETAS for an optimizer with betas (either role)."""
    return BETAS if has_betas(name) else None


def reference_hyper(name, lr, weight_decay):
    """The reference's hyper-parameters of a group: lr and weight decay, BETAS where the
    optimizer has betas, the table's defaults for the rest."""
    h = dict(lr=lr, weight_decay=weight_decay)
    if has_betas(name):
        h.update(beta1=BETAS[0], beta2=BETAS[1])
    return h


_REFERENCE_RUNS = {}


def reference_run(name):
    """TinyLM trained by the reference: autograd's accumulation, the exact norm of
    R(g * s) and torch's clip formula, then reference_step per group reading R(R(g*s)*c)
    with the group's scheduled lr. Returns per step (params bits, [{slot: bits}], steps)."""
    if name in _REFERENCE_RUNS:
        return _REFERENCE_RUNS[name]
    model = TinyLM()
    groups = make_groups(model)
    params = [p for g in groups for p in g["params"]]
    state = []
    for g in groups:
        h = reference_hyper(name, 1e-2, g["weight_decay"])
        state.append(reference_state(name, h, [p.detach() for p in g["params"]]))
    records = []
    for step in range(STEPS):
        mbs = micro_batches(step)
        scale = 1.0 / tokens_of(mbs)
        for p in params:
            p.grad = None
        for mb in mbs:
            loss_sum(model, mb).backward()
        with torch.no_grad():
            s32 = torch.tensor(scale, dtype=torch.float32)
            norm = f32(exact_norm([p.grad * s32 for p in params]))
            clip = float(torch.clamp(max_norm_at(step) / (torch.tensor(norm) + 1e-6), max=1.0))
        for g, (slots, steps) in zip(groups, state):
            h = reference_hyper(name, 1e-2 * schedule(step), g["weight_decay"])
            stepcore.reference_step(name, [p.detach() for p in g["params"]], slots, steps,
                                    [p.grad for p in g["params"]], hyper=h, grad_scale=scale,
                                    clip=clip)
        used = stepcore.optimizer_slots(name, reference_hyper(name, 1e-2, 0.0))
        per_param = []
        for g, (slots, steps) in zip(groups, state):
            for i in range(len(g["params"])):
                per_param.append(({n: bits(slots[k][i]) for k, n in enumerate(used)},
                                  None if steps is None else float(steps[i])))
        records.append(([bits(p) for p in params], per_param))
    _REFERENCE_RUNS[name] = records
    return records


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_gradient_manager_steps_every_optimizer_as_the_reference(name, mode, overlap):
    """GradientManager(optimizer=name) in every mode, with and without overlap (300-element
    chunks speculated, then committed or rolled back), two groups under a LambdaLR
    schedule, clip_grad_norm_ every step (clipped and unclipped steps): params, every
    state slot and step counter equal the reference's after every step."""
    want = reference_run(name)
    model = TinyLM()
    gm = st.GradientManager(make_groups(model), offload=mode, optimizer=name, lr=1e-2,
                            betas=manager_betas(name), weight_decay=WD, threads=2,
                            chunk_elements=300, speculation="always")
    sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
    try:
        assert gm._m.state_slot_names == stepcore.optimizer_slots(
            name, reference_hyper(name, 1e-2, 0.0))
        for step in range(STEPS):
            _, rep = drive(gm, model, sched, step, overlap)
            assert rep["stepped"] and not rep["skipped"], rep
            if overlap:
                assert rep["chunks_speculated"] > 0, rep
            sd = gm.state_dict()["state"]
            params = [p for g in gm.param_groups for p in g["params"]]
            want_params, want_state = want[step]
            for i, p in enumerate(params):
                what = f"{name} {mode} overlap={overlap} step {step} param {i}"
                assert torch.equal(bits(p), want_params[i]), what
                slots, counter = want_state[i]
                for slot, b in slots.items():
                    assert torch.equal(bits(sd[i][slot]), b), f"{what} {slot}"
                assert set(sd[i]) - {"master", "step"} == set(slots), what
                if counter is not None:
                    assert float(sd[i]["step"]) == counter, f"{what} step counter"
                else:
                    assert "step" not in sd[i], what
    finally:
        gm.close()


@pytest.mark.parametrize("name", [n for n in NAMES if not has_betas(n)])
def test_betas_for_an_optimizer_without_them_are_refused(name):
    """The table says which optimizers have betas: for the others `betas` is named."""
    with pytest.raises(ValueError, match=f"'betas' is not a hyper-parameter of optimizer "
                                         f"'{name}'"):
        st.GradientManager(TinyLM(), offload="full", optimizer=name, betas=(0.9, 0.99))


def manager_wide_names():
    """The optimizers whose beta1 and beta2 are manager-wide (role fixed)."""
    return [n for n in NAMES if has_betas(n) and any(
        h["name"] == "beta1" and h["role"] == "fixed" for h in ENTRY[n]["hyper"])]


@pytest.mark.parametrize("name", manager_wide_names())
def test_manager_wide_betas_are_one_value_for_every_group(name):
    """Role fixed (Lion's betas): `betas` sets them for every group; a group with other
    betas is refused naming it; the same value in a group is accepted; `betas` and
    `hyper` setting beta1 both is refused; and a group-role beta in `hyper` is refused."""
    model = TinyLM()
    groups = make_groups(model)
    groups[1]["betas"] = (0.5, 0.5)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['betas'\].*one value for every"):
        st.GradientManager(groups, offload="full", optimizer=name, betas=BETAS)
    groups[1]["betas"] = BETAS
    st.GradientManager(groups, offload="full", optimizer=name, betas=BETAS).close()
    with pytest.raises(ValueError, match="'beta1' is set twice"):
        st.GradientManager(TinyLM(), offload="full", optimizer=name, betas=BETAS,
                           hyper={"beta1": 0.8})
    gm = st.GradientManager(TinyLM(), offload="full", optimizer=name, hyper={"beta2": 0.9})
    assert gm.param_groups[0]["betas"][1] == 0.9
    gm.close()


def test_group_values_in_hyper_are_refused():
    """A field whose role is the groups' (lr, weight_decay, the Adam family's betas) is not
    the manager's: `hyper` setting one is refused naming it."""
    for name in NAMES:
        for h in ENTRY[name]["hyper"]:
            if h["role"] in ("schedule", "betas"):
                with pytest.raises(ValueError, match=f"'hyper' sets '{h['name']}'"):
                    st.GradientManager(TinyLM(), offload="full", optimizer=name,
                                       hyper={h["name"]: h["default"]})


def test_q8_says_which_optimizers_take_8_bit_slots():
    """'q8' against behaviour: an optimizer whose entry says so steps 8-bit slots as the
    reference does; the others refuse them, naming the slot."""
    import numpy as np
    engine = stepcore.Engine(threads=1)
    assert [e["name"] for e in TABLE if e["q8"]] != []
    for e in TABLE:
        defaults = {h["name"]: h["default"] for h in e["hyper"]}
        used = len(stepcore.optimizer_slots(e["name"], defaults))
        if used == 0:
            assert not e["q8"], e["name"]
            continue
        rng = np.random.default_rng(3)
        p = rng.standard_normal(300, dtype=np.float32)
        g = rng.standard_normal(300, dtype=np.float32)
        steps = [np.zeros((), np.float32)] if e["counts_steps"] else None
        mine = [[(np.full(300, k, np.uint8), np.full(2, 1e-3, np.float32))] for k in range(used)]
        if not e["q8"]:
            with pytest.raises(TypeError, match=r"states\[0\]\[0\]"):
                engine.step(e["name"], [p], mine, steps, [g], hyper=defaults)
            continue
        theirs = [[(c.copy(), a.copy()) for c, a in slot] for slot in mine]
        q = p.copy()
        steps2 = [np.zeros((), np.float32)] if steps else None
        engine.step(e["name"], [p], mine, steps, [g], hyper=defaults)
        stepcore.reference_step(e["name"], [q], theirs, steps2, [g], hyper=defaults)
        assert p.tobytes() == q.tobytes(), e["name"]
        for a, b in zip(mine, theirs):
            assert a[0][0].tobytes() == b[0][0].tobytes(), e["name"]
            assert a[0][1].tobytes() == b[0][1].tobytes(), e["name"]


def test_8bit_names_come_from_the_library():
    """The 8-bit names, written out here: each names its optimizer with 8-bit state and
    torchao's formula, in the library (optimizer_choice) and in every Python surface that
    takes a name; an 8-bit name of an optimizer without 8-bit state is refused naming
    'optimizer'."""
    assert stepcore._core.optimizer_choice("adamw8bit") == ("adamw", True, {"formula": "torchao"})
    assert stepcore._core.optimizer_choice("adam8bit") == ("adam", True, {"formula": "torchao"})
    assert stepcore._core.optimizer_choice("lion") == ("lion", False, {})
    for bad in ("sgd8bit", "lion8bit", "AdamW8bit", "8bit", ""):
        with pytest.raises(ValueError, match="'optimizer'"):
            stepcore._core.optimizer_choice(bad)
        with pytest.raises(ValueError, match="'optimizer'"):
            stepcore.plan_memory(1000, offload="full", optimizer=bad)
    plan = stepcore.plan_memory([[5000]], offload="full", optimizer="adam8bit")
    assert plan["kinds"]["exp_avg"]["bytes"] < 5000 * 4, plan
