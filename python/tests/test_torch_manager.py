"""Tests of stepcore.torch.GradientManager driving a real nn.Module training loop.

The independent reference is plain torch: the same model trained with autograd's own
gradient accumulation, the step's scale as an f32 multiply, the exact norm (Python
integers, exact.py), torch's clip coefficient formula, torch's multiply for the clip and
torch.optim.AdamW(fused=True) under the same LambdaLR schedule, with a max_norm that
varies by step so that clipped and unclipped steps alternate. Every mode (none, optimizer,
full), with and without optimizer overlap (speculated chunks committed or rolled back, under
every speculation policy and budget), must give its bits after every step: parameters,
moments, step counters, norms and clip coefficients; on 1 and 2 gloo processes (FSDP2
fully_shard); and through a state_dict saved in one mode and loaded in another. A
non-finite gradient (on one rank) skips the whole step, overlapped or not.
"""

import hashlib
import math
import os
import subprocess
import sys
import tempfile
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="stepcore.torch tests need PyTorch")

import stepcore.torch as st  # noqa: E402
from exact import exact_norm  # noqa: E402
from ranks import communicate_all  # noqa: E402

MODES = ("none", "optimizer", "full")
VOCAB, HIDDEN = 61, 12
MAX_NORM = 0.05
# The step norms are about 0.3-0.4: max_norm 0.05 clips (coefficient about 0.15), 1.0 does
# not (coefficient 1), so steps 0 and 3 are clipped and steps 1, 2 and 4 are not.
MAX_NORMS = (MAX_NORM, 1.0, 1.0, MAX_NORM, 1.0)
BETAS, WD = (0.9, 0.95), 0.1


class TinyLM(torch.nn.Module):
    """A next-token model small enough to check exactly: embedding, norm, MLP, head."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.head = torch.nn.Linear(2 * HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, tokens):
        return self.head(torch.tanh(self.up(self.norm(self.embed(tokens)))))


def micro_batches(step, rank=None):
    """Returns the step's micro-batches: (tokens, targets) of uneven lengths, -100 = pad."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for k in range(3):
        rows, length = 2 + k, 5 + 3 * k
        tokens = torch.randint(0, VOCAB, (rows, length), generator=g)
        targets = torch.randint(0, VOCAB, (rows, length), generator=g)
        cut = torch.randint(1, length + 1, (rows,), generator=g)
        for r in range(rows):
            targets[r, cut[r]:] = -100  # uneven token counts
        out.append((tokens, targets))
    return out


def loss_sum(model, mb):
    """The micro-batch's summed token loss (the step scales by 1 / tokens)."""
    tokens, targets = mb
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum")


def tokens_of(mbs):
    """The step's loss tokens."""
    return sum(int((t != -100).sum()) for _, t in mbs)


def schedule(step):
    """Warm-up over 2 steps, then cosine to 10 %."""
    if step < 2:
        return (step + 1) / 2
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 2) / 4)))


def f32(x):
    """x rounded to f32, as a Python float."""
    return torch.tensor(x, dtype=torch.float32).item()


def bits(t):
    """The tensor's bit patterns (int32 view of an f32 copy's bytes)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.contiguous().view(torch.int32).clone()


def make_groups(model):
    """Two torch-style groups: no weight decay for norms and biases."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WD, "name": "decay"},
            {"params": rest, "weight_decay": 0.0, "name": "no_decay"}]


# ---- the reference: plain torch ------------------------------------------------------


def max_norm_at(step):
    """The step's max_norm (MAX_NORMS, then MAX_NORM)."""
    return MAX_NORMS[step] if step < len(MAX_NORMS) else MAX_NORM


def train_with_torch(model, steps, norm_of):
    """Trains `model` with plain torch and returns per-step records (params bits, state
    bits, norm, clip): autograd's accumulation, g = R(g * s) and then R(g * c) in place on
    each (local) gradient, torch.optim.AdamW(fused=True) under the schedule.
    norm_of(step, scaled local grads) gives the step's norm, or None for no clipping; the
    coefficient is torch's min(1, max_norm_at(step) / (norm + 1e-6))."""
    groups = make_groups(model)
    for g in groups:
        g.pop("name")
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=BETAS, eps=1e-8, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    params = [p for g in opt.param_groups for p in g["params"]]
    records = []
    for step in range(steps):
        mbs = micro_batches(step)
        scale = torch.tensor(1.0 / tokens_of(mbs), dtype=torch.float32)
        for mb in mbs:
            loss_sum(model, mb).backward()  # autograd accumulates: copy, then f32 adds
        with torch.no_grad():
            local = [_local_value(p.grad) for p in params]
            for g in local:
                g.copy_(g * scale)  # R(g * s)
            norm = norm_of(step, local)
            clip = 1.0
            if norm is not None:
                clip = float(torch.clamp(max_norm_at(step) / (torch.tensor(norm) + 1e-6),
                                         max=1.0))
                for g in local:
                    g.copy_(g * torch.tensor(clip, dtype=torch.float32))  # R(R(g*s)*c)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        records.append(([bits(p) for p in params],
                        [(bits(opt.state[p]["exp_avg"]), bits(opt.state[p]["exp_avg_sq"]),
                          float(_local_value(opt.state[p]["step"]))) for p in params],
                        norm, clip))
    return records


def _local_value(t):
    """A DTensor's local tensor (or scalar), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def run_reference(steps, clip):
    """The reference records: plain torch with the exact norm (clip), or without clipping."""
    return train_with_torch(TinyLM(), steps,
                            lambda step, grads: f32(exact_norm(grads)) if clip else None)


# ---- the manager ------------------------------------------------------------------------


def backward_steps(gm, model, step, overlap):
    """begin_step and the step's micro-batches' backwards (the final one last)."""
    mbs = micro_batches(step)
    gm.begin_step(1.0 / tokens_of(mbs), overlap_optimizer=overlap)
    for k, mb in enumerate(mbs):
        gm.begin_backward(final_backward=k == len(mbs) - 1)
        loss_sum(model, mb).backward()
        gm.finish_backward()


def drive(gm, model, sched, step, overlap, clip=True):
    """One training step through the manager (clip_grad_norm_ with the step's max_norm
    unless not `clip`, with or without overlap); returns (norm or None, report)."""
    backward_steps(gm, model, step, overlap)
    norm = gm.clip_grad_norm_(max_norm_at(step)) if clip else None
    gm.step()
    sched.step()
    return norm, gm.report()


def record(gm, model, norm, rep):
    """The step's record in the reference's form, and the step's report last."""
    sd = gm.state_dict()["state"]
    params = [p for g in gm.param_groups for p in g["params"]]
    return ([bits(p) for p in params],
            [(bits(sd[i]["exp_avg"]), bits(sd[i]["exp_avg_sq"]), float(sd[i]["step"]))
             for i in range(len(params))],
            None if norm is None else norm.item(), rep["clip_coefficient"], rep)


def run_manager(mode, steps, overlap, *, clip=True, **kw):
    """Trains TinyLM through a GradientManager in `mode`; returns the per-step records."""
    model = TinyLM()
    gm = st.GradientManager(make_groups(model), offload=mode, lr=1e-2, betas=BETAS,
                            weight_decay=WD, threads=2, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
    records = []
    try:
        for step in range(steps):
            norm, rep = drive(gm, model, sched, step, overlap, clip)
            records.append(record(gm, model, norm, rep))
    finally:
        gm.close()
    return records


def assert_records_equal(got, want, what):
    """Asserts two runs' records are bit-identical after every step."""
    assert len(got) == len(want)
    for s, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g[0], w[0])):
            assert torch.equal(a, b), (f"{what}: step {s} param {i}: "
                                       f"{a.view(torch.float32)} != {b.view(torch.float32)}")
        for i, (a, b) in enumerate(zip(g[1], w[1])):
            assert torch.equal(a[0], b[0]), f"{what}: step {s} exp_avg {i}"
            assert torch.equal(a[1], b[1]), f"{what}: step {s} exp_avg_sq {i}"
            assert a[2] == b[2], f"{what}: step {s} step counter {i}"
        assert g[2] == w[2], f"{what}: step {s} norm {g[2]} != {w[2]}"
        assert f32(g[3]) == f32(w[3]), f"{what}: step {s} clip {g[3]} != {w[3]}"


STEPS = 5
CLIPPED = [s for s in range(STEPS) if max_norm_at(s) == MAX_NORM]  # steps 0 and 3


@pytest.fixture(scope="module")
def reference():
    """The reference records: "clipped" (clip_grad_norm_ with the step's max_norm; steps
    0 and 3 clip, the others do not) and "unclipped" (no clip_grad_norm_ at all)."""
    return {"clipped": run_reference(STEPS, True), "unclipped": run_reference(STEPS, False)}


@pytest.fixture(scope="module")
def serial():
    """Each mode's records without overlap, clip_grad_norm_ every step (300-element chunks)."""
    return {mode: run_manager(mode, STEPS, False, chunk_elements=300) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_reference_bits_after_every_step(mode, reference, serial):
    """Params, moments, counters, norms and clip coefficients equal plain torch's, every
    step, under a LambdaLR schedule (the manager reads each group's lr at every step)."""
    got = serial[mode]
    assert_records_equal(got, reference["clipped"], mode)
    coefficients = [r[3] for r in got]
    assert [s for s, c in enumerate(coefficients) if c < 1.0] == CLIPPED, coefficients
    for r in got:  # no overlap: nothing speculated
        assert (r[4]["chunks_speculated"], r[4]["chunks_committed"],
                r[4]["chunks_rolled_back"]) == (0, 0, 0), r[4]


def check_speculation_counts(records, speculation, speculation_bytes, what):
    """The report's chunk counts of an overlapped AdamW run whose steps all clip_grad_norm_:
    committed + rolled_back == speculated; none with "never" or budget 0; with "always"
    every step speculates, a clipped step rolls back everything speculated and an
    unclipped one commits it; "auto" speculates at the first step and after a step that
    kept its speculation (coefficient 1), and waits after a clipped one."""
    for s, r in enumerate(records):
        rep, clipped = r[4], r[3] < 1.0
        spec, kept, back = (rep["chunks_speculated"], rep["chunks_committed"],
                            rep["chunks_rolled_back"])
        where = f"{what}: step {s} report {rep}"
        assert kept + back == spec, where
        assert rep["stepped"] and not rep["skipped"], where
        assert rep["exposed_seconds"] >= 0.0, where
        if speculation == "never" or speculation_bytes == 0:
            assert spec == 0, where
            continue
        if speculation == "always":
            assert spec > 0, where
        else:  # auto
            assert (spec > 0) == (s == 0 or records[s - 1][3] == 1.0), where
        if clipped:  # AdamW with a coefficient < 1: every speculated chunk is rolled back
            assert (kept, back) == (0, spec), where
        else:
            assert (kept, back) == (spec, 0), where


@pytest.mark.parametrize("speculation_bytes", [-1, 0], ids=["all_chunks", "no_budget"])
@pytest.mark.parametrize("speculation", ["always", "never", "auto"])
@pytest.mark.parametrize("mode", MODES)
def test_overlapped_steps_with_clipping_give_the_serial_bits(mode, speculation,
                                                            speculation_bytes, reference,
                                                            serial):
    """clip_grad_norm_ after begin_step(s, overlap_optimizer=True): the speculated chunks
    are committed (unclipped steps) or rolled back and stepped again with the coefficient
    (clipped steps); after every step the bits are the non-overlapped run's and plain
    torch's, under every policy and budget."""
    what = f"{mode} overlap speculation={speculation} speculation_bytes={speculation_bytes}"
    got = run_manager(mode, STEPS, True, chunk_elements=300, speculation=speculation,
                      speculation_bytes=speculation_bytes)
    assert_records_equal(got, serial[mode], what + " vs no overlap")
    assert_records_equal(got, reference["clipped"], what + " vs torch")
    check_speculation_counts(got, speculation, speculation_bytes, what)


@pytest.mark.parametrize("mode", MODES)
def test_a_partial_speculation_budget_speculates_some_chunks_and_changes_no_bit(mode, serial):
    """speculation_bytes that hold a few chunks' rollback space (a 300-element chunk needs
    about 3.6 to 5 kB): fewer chunks speculate than with the whole budget, some do, and the
    bits are the serial run's."""
    whole = run_manager(mode, STEPS, True, chunk_elements=300, speculation="always")
    part = run_manager(mode, STEPS, True, chunk_elements=300, speculation="always",
                       speculation_bytes=10000)
    for runs, what in ((whole, "all chunks"), (part, "10000 bytes")):
        assert_records_equal(runs, serial[mode], f"{mode} overlap, budget {what}")
        check_speculation_counts(runs, "always", -1, f"{mode} budget {what}")
    for s, (a, b) in enumerate(zip(part, whole)):
        assert 0 < a[4]["chunks_speculated"] < b[4]["chunks_speculated"], (s, a[4], b[4])


@pytest.mark.parametrize("staging", [-1, 4096], ids=["every_chunk", "a_few_chunks"])
def test_device_staging_of_speculated_weights_changes_no_bit(staging, serial, reference):
    """offload='full' with speculation_device_bytes: speculated compute weights are
    staged on the device during backward and a commit copies them from there (every
    chunk, or the first few that fit 4096 bytes, the others uploading after the commit);
    the bits are the serial run's and torch's."""
    got = run_manager("full", STEPS, True, chunk_elements=300, speculation="always",
                      speculation_device_bytes=staging)
    what = f"full overlap, device staging {staging}"
    assert_records_equal(got, serial["full"], what + " vs no overlap")
    assert_records_equal(got, reference["clipped"], what + " vs torch")
    check_speculation_counts(got, "always", -1, what)


@pytest.mark.parametrize("mode", MODES)
def test_overlapped_steps_without_clipping_commit_and_give_torchs_bits(mode, reference):
    """No clip_grad_norm_: step() decides (coefficient 1, finite), so every speculated
    chunk is committed; the bits are plain torch's without clipping."""
    got = run_manager(mode, STEPS, True, clip=False, chunk_elements=300, speculation="always")
    assert_records_equal(got, reference["unclipped"], f"{mode} overlap without clipping")
    for s, r in enumerate(got):
        rep = r[4]
        assert r[3] == 1.0 and rep["chunks_speculated"] > 0, (s, rep)
        assert rep["chunks_committed"] == rep["chunks_speculated"], (s, rep)
        assert rep["chunks_rolled_back"] == 0, (s, rep)


def test_state_dict_saved_in_one_mode_resumes_in_another(reference):
    """full for 2 steps, state_dict, then mode none (a new model and manager) for 3 more:
    the bits of an uninterrupted run."""
    model = TinyLM()
    gm = st.GradientManager(make_groups(model), offload="full", lr=1e-2, betas=BETAS,
                            weight_decay=WD, threads=2)
    sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
    for step in range(2):
        drive(gm, model, sched, step, False)
    saved = gm.state_dict()
    saved = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in saved["state"].items()},
             "param_groups": [dict(g) for g in saved["param_groups"]]}
    sched_state = sched.state_dict()
    params_now = [p.detach().clone() for p in model.parameters()]
    gm.close()

    model2 = TinyLM(seed=99)  # other values: load_state_dict must restore the masters
    gm2 = st.GradientManager(make_groups(model2), offload="none", lr=1e-2, betas=BETAS,
                             weight_decay=WD, threads=1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(gm2, schedule)  # torch's resume order
    gm2.load_state_dict(saved)
    sched2.load_state_dict(sched_state)
    for p, q in zip(model2.parameters(), params_now):
        assert torch.equal(p.detach(), q), "load_state_dict writes the compute weights"
    records = []
    try:
        for step in range(2, STEPS):
            norm, rep = drive(gm2, model2, sched2, step, False)
            records.append(record(gm2, model2, norm, rep))
    finally:
        gm2.close()
    assert_records_equal(records, reference["clipped"][2:], "full -> none resume")


def test_state_dict_is_a_view_of_the_host_state_in_modes_optimizer_and_full():
    """No copy: the state_dict's tensors are the manager's host memory (a checkpoint reads
    the live state), and in mode none they are copies."""
    for mode in MODES:
        model = TinyLM()
        gm = st.GradientManager(model, offload=mode, lr=1e-2, threads=1)
        sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
        drive(gm, model, sched, 0, False)
        a, b = gm.state_dict()["state"][0], gm.state_dict()["state"][0]
        shared = all(a[k].data_ptr() == b[k].data_ptr() for k in ("master", "exp_avg"))
        assert shared == (mode != "none"), mode
        gm.close()


def test_state_dict_interoperates_with_torch_adamw(reference):
    """The manager's state_dict loads into torch.optim.AdamW (and the params it holds)."""
    model = TinyLM()
    gm = st.GradientManager(make_groups(model), offload="optimizer", lr=1e-2, betas=BETAS,
                            weight_decay=WD, threads=1)
    sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
    for step in range(2):
        drive(gm, model, sched, step, False)
    sd = gm.state_dict()
    groups = make_groups(model)
    for g in groups:
        g.pop("name")
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=BETAS, fused=True)
    opt.load_state_dict(sd)
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        assert torch.equal(bits(opt.state[p]["exp_avg"]), reference["clipped"][1][1][i][0])
    gm.close()


# ---- the error catalogue -------------------------------------------------------------


def fingerprint(model, gm=None):
    """A hash of the model's params and (when given) the manager's state."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    if gm is not None:
        for i, s in sorted(gm.state_dict()["state"].items()):
            for k in sorted(s):
                h.update(k.encode())
                h.update(s[k].numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("offload", ["fsdp", "cpu", "Full", "", None, 1])
def test_unknown_offload_modes_are_refused(offload):
    with pytest.raises(ValueError, match=r"'offload' must be one of 'none', 'optimizer', 'full'"):
        st.GradientManager(TinyLM(), offload=offload)


def test_fsdp_names_its_replacement_and_an_unknown_optimizer_is_named():
    import re

    import stepcore

    with pytest.raises(ValueError, match="fsdp.*removed"):
        st.GradientManager(TinyLM(), offload="fsdp")
    table = stepcore.optimizer_table()
    # The table's names (lion included), then the 8-bit names of its q8 optimizers.
    names = ", ".join([repr(e["name"]) for e in table]
                      + [repr(e["name"] + "8bit") for e in table if e["q8"]])
    assert "'lion'" in names and "'adamw8bit'" in names
    with pytest.raises(ValueError,
                       match=re.escape(f"'optimizer' must be one of {names}; got 'muon'")):
        st.GradientManager(TinyLM(), offload="full", optimizer="muon")


def prepared(mode="full", threads=1):
    """A model, its manager and scheduler after one step."""
    model = TinyLM()
    gm = st.GradientManager(model, offload=mode, lr=1e-2, threads=threads)
    sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
    drive(gm, model, sched, 0, False)
    return model, gm, sched


@pytest.mark.parametrize("name, value", [
    ("speculation", "sometimes"), ("speculation", "Auto"), ("speculation", None),
    ("speculation_bytes", -2), ("speculation_bytes", 1.5), ("speculation_bytes", True)])
def test_bad_speculation_arguments_are_refused_before_anything_is_built(name, value,
                                                                        monkeypatch):
    """ValueError naming the argument, raised before the C++ manager or any hook exists."""
    import stepcore

    def built(*args, **kwargs):
        raise AssertionError("the C++ manager was built")

    monkeypatch.setattr(stepcore._core, "GradientManager", built)
    model = TinyLM()
    with pytest.raises(ValueError, match=f"'{name}'"):
        st.GradientManager(model, offload="full", **{name: value})
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None), "a hook was registered"


def overlapped_manager(mode, **kw):
    """A model and its manager (300-element chunks, speculation "always" unless given)
    after one serial step."""
    kw.setdefault("speculation", "always")
    model = TinyLM()
    gm = st.GradientManager(make_groups(model), offload=mode, lr=1e-2, betas=BETAS,
                            weight_decay=WD, threads=1, chunk_elements=300, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
    drive(gm, model, sched, 0, False)
    return model, gm, sched


@pytest.mark.parametrize("overlap", [False, True], ids=["no_overlap", "overlap"])
@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_norm_twice_in_a_step_is_refused_and_changes_nothing(mode, overlap,
                                                                      reference):
    """The second clip_grad_norm_ of a step raises naming clip_grad_norm; the params are
    unchanged (the state cannot be read inside a step), and step() then gives the bits of
    a step clipped once: params, moments, counters, norm and coefficient."""
    model, gm, sched = overlapped_manager(mode)
    backward_steps(gm, model, 1, overlap)
    norm = gm.clip_grad_norm_(max_norm_at(1))
    before = fingerprint(model)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        gm.clip_grad_norm_(MAX_NORM)  # another max_norm: must not change the coefficient
    assert fingerprint(model) == before
    gm.step()
    sched.step()
    got = record(gm, model, norm, gm.report())
    gm.close()
    assert_records_equal([got], reference["clipped"][1:2], f"{mode} overlap={overlap}")


def poison_first_element(param, when):
    """A tensor hook that makes the first element of `param`'s gradient NaN while when()."""
    def hook(g):
        if not when():
            return g
        g = g.clone()
        g.view(-1)[0] = float("nan")
        return g
    return param.register_hook(hook)


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "no_clip"])
@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_gradient_with_overlap_skips_the_whole_step(mode, clip):
    """NaN in one element of embed.weight's gradient (the last gradient of the backward,
    so the other chunks have been speculated): every speculated chunk is rolled back and
    the whole step is skipped: params, moments and counters unchanged, report skipped.
    The next step trains on."""
    model, gm, sched = overlapped_manager(mode)
    poisoned = [True]
    handle = poison_first_element(model.embed.weight, lambda: poisoned[0])
    before = fingerprint(model, gm)
    backward_steps(gm, model, 1, True)
    if clip:
        norm = gm.clip_grad_norm_(MAX_NORM)
        assert not math.isfinite(norm.item()), norm
    gm.step()
    rep = gm.report()
    assert rep["skipped"] and not rep["stepped"] and not rep["finite"], rep
    assert rep["chunks_speculated"] > 0, rep
    assert (rep["chunks_committed"], rep["chunks_rolled_back"]) == \
        (0, rep["chunks_speculated"]), rep
    assert fingerprint(model, gm) == before
    poisoned[0] = False
    handle.remove()
    norm, rep = drive(gm, model, sched, 1, True)
    assert math.isfinite(norm.item()) and rep["stepped"] and not rep["skipped"], rep
    assert fingerprint(model, gm) != before
    gm.close()


def handoff_run(gated):
    """One step of offload "full" on the host device in which each gradient handed over is
    doubled by its producer. gated: the doubling lands after the hooks ran, before the
    write's event (a HostEvent standing for the event the hook records on torch's current
    stream); else before the hooks. Returns (param bits, norm)."""
    import threading
    import weakref

    import stepcore

    model = TinyLM()
    seen = []

    def producer(p):
        if gated:
            seen.append(p.grad)
        else:
            p.grad.mul_(2)

    for p in model.parameters():  # registered first: runs before the manager's hook
        p.register_post_accumulate_grad_hook(producer)
    gm = st.GradientManager(model, offload="full", lr=1e-2, betas=BETAS, threads=1)
    gate = stepcore._core.Event.host()
    if gated:
        gm._written_event = lambda stream: gate  # the host device: no stream to record on
    opener = threading.Timer(30, gate.set)  # a host wait for the gate would hang otherwise
    try:
        mbs = micro_batches(0)
        gm.begin_step(1.0 / tokens_of(mbs[:1]), overlap_optimizer=False)
        gm.begin_backward(final_backward=True)
        loss_sum(model, mbs[0]).backward()
        if gated:
            with torch.no_grad():
                torch._foreach_mul_(seen, 2.0)  # the producer's write, queued at the hooks
            kept = [weakref.ref(g) for g in seen]
            seen.clear()
            opener.start()
            gm.finish_backward()
            # It returned with the manager's reads still waiting for the write's event
            # (no host wait), and the adapter keeps every gradient until they are done.
            assert not gate.complete(), "finish_backward waited on the host"
            assert all(r() is not None for r in kept), "a gradient was given back unread"
            gate.set()
        else:
            gm.finish_backward()
        gm.clip_grad_norm_(MAX_NORM)
        gm.step()
        if gated:
            import gc

            gc.collect()
            assert all(r() is None for r in kept), "the step kept a read gradient alive"
        return [bits(p) for p in model.parameters()], gm.report()["norm"]
    finally:
        gate.set()
        opener.cancel()
        gm.close()


def test_a_handoff_is_ordered_by_the_write_event_not_by_a_host_wait():
    """The hook hands each gradient over with the event of its write: the manager's reads
    wait for it on the device (the host device's copy queue), so a write that lands after
    the hook but before the event is the one stepped, bit for bit as if it had landed
    before the hook; finish_backward releases the gradients without waiting on the host."""
    got_params, got_norm = handoff_run(gated=True)
    want_params, want_norm = handoff_run(gated=False)
    assert got_norm == want_norm
    for k, (got, want) in enumerate(zip(got_params, want_params)):
        assert torch.equal(got, want), f"param {k}"


@pytest.mark.parametrize("mode", MODES)
def test_a_hook_firing_twice_in_one_micro_batch_is_refused(mode):
    """Two backwards in one micro-batch: the second hook of a parameter raises naming it,
    and neither the params nor the manager's state change."""
    model, gm, _ = prepared(mode)
    mbs = micro_batches(1)
    gm.begin_step(1.0 / tokens_of(mbs), overlap_optimizer=False)
    gm.begin_backward(final_backward=False)
    loss_sum(model, mbs[0]).backward()
    params = fingerprint(model)
    with pytest.raises(ValueError, match=r"params\[\d+\] \(\w+\.\w+\).*already ready"):
        loss_sum(model, mbs[1]).backward()  # the second backward in one micro-batch
    assert fingerprint(model) == params
    gm.finish_backward()
    gm.close()


@pytest.mark.parametrize("mode", MODES)
def test_step_before_finish_backward_is_refused_and_changes_nothing(mode):
    model, gm, _ = prepared(mode)
    mbs = micro_batches(1)
    gm.begin_step(1.0 / tokens_of(mbs), overlap_optimizer=False)
    gm.begin_backward(final_backward=True)
    loss_sum(model, mbs[0]).backward()
    params = fingerprint(model)
    with pytest.raises(ValueError, match="step"):
        gm.step()
    assert fingerprint(model) == params
    gm.finish_backward()
    gm.clip_grad_norm_(MAX_NORM)
    gm.step()
    gm.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_whose_dtype_changes_is_refused(mode):
    model, gm, _ = prepared(mode)
    p = model.up.weight
    if not hasattr(p, "grad_dtype"):
        pytest.skip("this torch has no grad_dtype")
    p.grad_dtype = torch.bfloat16  # autograd now delivers bf16 for an f32 parameter
    mbs = micro_batches(1)
    before = fingerprint(model)
    gm.begin_step(1.0 / tokens_of(mbs), overlap_optimizer=False)
    gm.begin_backward(final_backward=True)
    with pytest.raises(TypeError, match=r"params\[\d+\] \(up.weight\)"):
        loss_sum(model, mbs[0]).backward()
    assert fingerprint(model) == before
    gm.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_non_contiguous_gradient_is_refused(mode):
    model, gm, _ = prepared(mode)
    p = model.up.weight

    def strided(param):  # another framework's hook that runs first
        param.grad = torch.randn(param.shape[1], param.shape[0]).t()

    handle = p.register_post_accumulate_grad_hook(strided)
    # Hooks run in registration order: move ours after it by re-registering.
    mbs = micro_batches(1)
    before = fingerprint(model)
    gm.begin_step(1.0 / tokens_of(mbs), overlap_optimizer=False)
    gm.begin_backward(final_backward=True)
    i = next(k for k, q in enumerate(q for g in gm.param_groups for q in g["params"]) if q is p)
    gm._hooks[i].remove()
    gm._hooks[i] = p.register_post_accumulate_grad_hook(gm._hook(i))
    with pytest.raises(ValueError, match=r"params\[\d+\] \(up.weight\).*contiguous"):
        loss_sum(model, mbs[0]).backward()
    assert fingerprint(model) == before
    handle.remove()
    gm.close()


def test_threads_come_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    gm = st.GradientManager(TinyLM(), offload="full")
    allowed = len(os.sched_getaffinity(0))
    assert gm.threads == min(allowed, os.cpu_count()), "OMP_NUM_THREADS alone changes nothing"
    gm.close()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    gm = st.GradientManager(TinyLM(), offload="full")
    assert gm.threads == max(1, min(allowed, os.cpu_count() // 2))
    gm.close()


# ---- two processes: FSDP2 on gloo ------------------------------------------------------
#
# Every rank runs the same micro-batches: FSDP's average of identical gradients is exact, so
# each rank's shard holds the single-process gradient's bits and the exact global norm is
# the single-process norm. The "native" formula is elementwise, so every shard's update is
# the single-process update's slice. The "torch" formula is torch's fused kernel, whose
# last numel % 8 elements of each tensor take its scalar tail: on shards those are the
# shards' tails, as torch.optim.AdamW(fused=True) on FSDP2 shards does; its peer here is
# exactly that (FSDP2, torch's accumulation, the scale and clip as torch multiplies, fused
# AdamW on the DTensor params), given the manager's norm, which must be the 1-process norm.


def sharded_model():
    """TinyLM under FSDP2: each submodule and the root fully_shard-ed."""
    from torch.distributed.fsdp import fully_shard

    model = TinyLM()
    for sub in (model.embed, model.norm, model.up, model.head):
        fully_shard(sub)
    fully_shard(model)
    return model


def torch_fsdp_peer(norms):
    """FSDP2 + torch.optim.AdamW(fused=True) given the step norms: the full params and
    moments after every step (the manager's torch-formula records on these shards)."""
    return train_with_torch(sharded_model(), len(norms), lambda step, grads: norms[step])


def dcp_resume(path):
    """Mode full for 2 steps, a distributed checkpoint (torch.distributed.checkpoint) of its
    state_dict (DTensor shards of the host state, no copy), then a new model and manager in
    mode none load it and train on: the records of steps 2.. (formula native)."""
    import torch.distributed.checkpoint as dcp

    model = sharded_model()
    gm = st.GradientManager(make_groups(model), offload="full", lr=1e-2, betas=BETAS,
                            weight_decay=WD, threads=1, formula="native")
    sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
    for step in range(2):
        drive(gm, model, sched, step, False)
    dcp.save({"optim": gm.state_dict()}, checkpoint_id=path)
    sched_state = sched.state_dict()
    gm.close()
    model2 = sharded_model()
    gm2 = st.GradientManager(make_groups(model2), offload="none", lr=1e-2, betas=BETAS,
                             weight_decay=WD, threads=1, formula="native")
    sched2 = torch.optim.lr_scheduler.LambdaLR(gm2, schedule)
    target = {"optim": gm2.state_dict()}
    dcp.load(target, checkpoint_id=path)
    gm2.load_state_dict(target["optim"])
    sched2.load_state_dict(sched_state)
    recs = []
    for step in range(2, STEPS):
        norm, rep = drive(gm2, model2, sched2, step, False)
        recs.append(record(gm2, model2, norm, rep))
    gm2.close()
    return recs


def local_fingerprint(model, gm):
    """A hash of this rank's shards of the params and of the manager's state."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(_local_value(p.detach()).contiguous().numpy().tobytes())
    for i, st_i in sorted(gm.state_dict()["state"].items()):
        for k in sorted(st_i):
            h.update(k.encode())
            h.update(_local_value(st_i[k]).contiguous().numpy().tobytes())
    return h.hexdigest()


def poison_before_the_manager(gm, p, when):
    """Makes the first element of p's local gradient NaN, while when(), in a
    post-accumulate-grad hook that runs before the manager's (FSDP2 sets the sharded
    param's grad after the reduce-scatter, so a tensor hook would not see it)."""
    i = next(k for k, q in enumerate(gm._params) if q is p)

    def hook(param):
        if when():
            _local_value(param.grad).view(-1)[0] = float("nan")

    handle = p.register_post_accumulate_grad_hook(hook)
    gm._hooks[i].remove()
    gm._hooks[i] = p.register_post_accumulate_grad_hook(gm._hook(i))
    return handle


def nan_on_one_rank(rank, mode):
    """A step with overlap and clipping whose gradient has a NaN on rank 1 only (the first
    element of its embed.weight shard, the backward's last gradient): returns this rank's
    (report, whether its params and state are unchanged)."""
    model = sharded_model()
    gm = st.GradientManager(make_groups(model), offload=mode, lr=1e-2, betas=BETAS,
                            weight_decay=WD, threads=1, chunk_elements=300, formula="native",
                            speculation="always")
    sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
    drive(gm, model, sched, 0, False)
    handle = poison_before_the_manager(gm, model.embed.weight, lambda: rank == 1)
    before = local_fingerprint(model, gm)
    _, rep = drive(gm, model, sched, 1, True)
    unchanged = local_fingerprint(model, gm) == before
    handle.remove()
    gm.close()
    return rep, unchanged


def fsdp_worker(rank, world, init_file, out_file):
    """One gloo process: every mode and formula under FSDP2 (overlapped runs clip too);
    saves rank 0's records and every rank's NaN-on-rank-1 outcome."""
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    results = {}
    runs = [(m, False, "auto") for m in MODES] + [("full", True, "always"),
                                                   ("none", True, "auto")]
    for formula in ("native", "torch"):
        for mode, overlap, speculation in runs:
            model = sharded_model()
            gm = st.GradientManager(make_groups(model), offload=mode, lr=1e-2, betas=BETAS,
                                    weight_decay=WD, threads=1, chunk_elements=300,
                                    formula=formula, speculation=speculation)
            sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
            recs = []
            for step in range(STEPS):
                norm, rep = drive(gm, model, sched, step, overlap)
                recs.append(record(gm, model, norm, rep))
            gm.close()
            results[(formula, mode, overlap, speculation)] = recs
    norms = [r[2] for r in results[("torch", "none", False, "auto")]]
    results["peer"] = torch_fsdp_peer(norms)
    results["dcp"] = dcp_resume(os.path.join(os.path.dirname(out_file), "dcp"))
    nan = {}
    for mode in MODES:
        everyone = [None] * world
        dist.all_gather_object(everyone, nan_on_one_rank(rank, mode))
        nan[mode] = everyone
    results["nan"] = nan
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out_file)
    # Leave at once: gloo's threads can abort interpreter shutdown ("terminate called without
    # an active exception", seen twice on a loaded 2-vCPU VM), and every result is written.
    sys.stdout.flush()
    os._exit(0)


def test_two_fsdp2_processes_give_the_single_process_bits(reference):
    """FSDP2 (fully_shard) on 2 gloo processes: the norm global over the ranks equals the
    1-process norm every step; native-formula runs equal the 1-process runs bit for bit in
    every mode, with or without overlap (clipping every step); torch-formula runs equal
    torch's fused AdamW on the same shards. A NaN in rank 1's gradient alone skips the
    overlapped step on both ranks: every rank's params and state unchanged."""
    native = run_manager("none", STEPS, False, formula="native")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tests_dir] + [p for p in sys.path if p])
    # torch's own CPU reductions (LayerNorm's weight gradient) depend on its thread count:
    # the workers use this process's, so their gradients are the reference's.
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        out = os.path.join(tmp, "rank0.pt")
        procs = [subprocess.Popen(
            [sys.executable, "-c", "import sys, test_torch_manager as t; "
             "t.fsdp_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])",
             str(r), str(world), init_file, out], env=env, cwd=tmp,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
        logs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
        for r, (p, log) in enumerate(zip(procs, logs)):
            assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
        results = torch.load(out, weights_only=False)
    peer = results.pop("peer")
    assert_records_equal(results.pop("dcp"), native[2:],
                         "2 processes: a distributed checkpoint of mode full resumed in mode none")
    for mode, ranks in results.pop("nan").items():
        for r, (rep, unchanged) in enumerate(ranks):
            what = f"2 processes {mode}, NaN on rank 1 only: rank {r} report {rep}"
            assert unchanged, what + ": params or state changed"
            assert rep["skipped"] and not rep["stepped"], what
            assert rep["chunks_committed"] == 0, what
            assert rep["chunks_rolled_back"] == rep["chunks_speculated"] > 0, what
    for (formula, mode, overlap, speculation), recs in results.items():
        what = f"2 processes {formula} {mode} overlap={overlap} speculation={speculation}"
        # The 1-process exact norm of the same formula: after the first step the params,
        # hence the gradients and the norm, are the formula's own.
        one_process = native if formula == "native" else reference["clipped"]
        for s, (got, want) in enumerate(zip(recs, one_process)):
            assert got[2] == want[2], f"{what}: step {s} norm"
        if formula == "native":
            assert_records_equal(recs, native, what)
        else:
            assert_records_equal(recs, peer, what + " (against FSDP2 + torch fused AdamW)")
        if overlap:
            check_speculation_counts(recs, speculation, -1, what)


# ---- the device-memory communicator on process groups ------------------------------------
# Each rank holds a contiguous slice of every parameter (uneven cuts) and the norm is global
# over the group; every mode must give the bits of one process holding everything, on the
# same device. Modes none and optimizer reduce the norm words in the device's memory (the
# device callback communicator: host memory on the host device, CUDA memory on the compute
# stream on a GPU), mode full in host memory. test_gpu.py runs the same workers on NCCL.

SLICE_SIZES = (1000, 37, 4099)
SLICE_STEPS = 4
INF_STEP = 2  # the last element of the last parameter (the last rank's) is +inf: skipped


def slice_bounds(n, rank, world):
    """Returns this rank's [lo, hi) of n elements: quadratic cut points (uneven)."""
    cut = lambda r: (n * r * r) // (world * world)  # noqa: E731
    return cut(rank), cut(rank + 1)


def slice_gradient(step, i, n):
    """The whole gradient of parameter i at `step` (identical in every process)."""
    g = torch.randn(n, generator=torch.Generator().manual_seed(100 * step + i)) * 10.0 ** (i - 1)
    if step == INF_STEP and i == len(SLICE_SIZES) - 1:
        g[-1] = math.inf
    return g


def sliced_run(mode, dev, group=None, world_size=None):
    """Trains SLICE_SIZES parameters on `dev` for SLICE_STEPS steps in `mode`: this rank's
    slices with a `group` (the manager told `world_size` ranks when given), the whole
    without. Returns ([(norm, skipped) per step], the final (param, exp_avg, exp_avg_sq) as
    CPU tensors, the communicator's name or None)."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)
    bounds = [slice_bounds(n, rank, world) for n in SLICE_SIZES]
    params = [torch.nn.Parameter(slice_gradient(-1, i, n)[lo:hi].to(dev))
              for i, (n, (lo, hi)) in enumerate(zip(SLICE_SIZES, bounds))]
    real = dist.get_world_size
    if world_size is not None:
        # One GPU holds one NCCL rank: the manager is told the group has world_size ranks, so
        # that it builds its communicator (an all-reduce over one rank is the identity).
        dist.get_world_size = lambda group=None: world_size
    try:
        gm = st.GradientManager(params, offload=mode, lr=1e-2, betas=BETAS, weight_decay=WD,
                                threads=1, formula="native", process_group=group)
    finally:
        dist.get_world_size = real
    steps = []
    for step in range(SLICE_STEPS):
        gm.begin_step(0.5)
        gm.begin_backward(final_backward=True)
        grads = [slice_gradient(step, i, n)[lo:hi].to(dev)
                 for i, (n, (lo, hi)) in enumerate(zip(SLICE_SIZES, bounds))]
        sum((p * g).sum() for p, g in zip(params, grads)).backward()  # p.grad = g exactly
        gm.finish_backward()
        norm = gm.clip_grad_norm_(1.0)
        gm.step()
        steps.append((norm.item(), gm.report()["skipped"]))
    sd = gm.state_dict()["state"]
    state = [(p.detach().cpu().clone(), sd[i]["exp_avg"].cpu().clone(),
              sd[i]["exp_avg_sq"].cpu().clone()) for i, p in enumerate(params)]
    name = gm._comm.name if gm._comm is not None else None
    gm.close()
    return steps, state, name


def sliced_mismatches(mode, dev, group, world_size=None):
    """Runs `mode` sharded over `group` and whole in this process; returns (the sharded
    run's communicator name, every difference from the whole run's bits)."""
    import torch.distributed as dist

    got_steps, got_state, name = sliced_run(mode, dev, group, world_size)
    want_steps, want_state, _ = sliced_run(mode, dev)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = []
    for s, (got, want) in enumerate(zip(got_steps, want_steps)):
        if f32(got[0]) != f32(want[0]) and not (math.isnan(got[0]) and math.isnan(want[0])):
            out.append(f"{mode} step {s}: norm {got[0]} != {want[0]}")
        if got[1] != want[1] or got[1] != (s == INF_STEP):
            out.append(f"{mode} step {s}: skipped {got[1]}, one process {want[1]}")
    for i, (n, g, w) in enumerate(zip(SLICE_SIZES, got_state, want_state)):
        lo, hi = slice_bounds(n, rank, world)
        for what, a, b in zip(("param", "exp_avg", "exp_avg_sq"), g, w):
            if not torch.equal(bits(a), bits(b[lo:hi])):
                out.append(f"{mode} params[{i}] {what}: rank {rank}'s slice differs")
    return name, out


def group_refusal(make_params, **kw):
    """Returns the message of the ValueError building a manager raises ('' for none)."""
    try:
        st.GradientManager(make_params(), lr=1e-2, threads=1, **kw).close()
    except ValueError as e:
        return str(e)
    return ""


def sliced_worker(rank, world, init_file, out_file, backend, world_size=None):
    """One process: every mode sharded over the default group (`backend`; nccl: on
    cuda:rank) against the whole run; a group without a backend for the parameters' memory,
    and one without this rank; saves {"comm": {mode: name}, "mismatches": [...],
    "refused": {case: message}, "not_member": message (rank 0: None)}."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    results = {"comm": {}, "mismatches": [], "refused": {}}
    for mode in MODES:
        name, bad = sliced_mismatches(mode, dev, dist.group.WORLD, world_size)
        results["comm"][mode] = name
        results["mismatches"] += bad
    # A group whose one backend serves the other memory: CUDA memory on "cpu:gloo" is
    # refused; host memory on "cuda:gloo" needs a GPU to stage through.
    other = "cpu:gloo" if dev.type == "cuda" else "cuda:gloo"
    group = dist.new_group(backend=other)
    for mode in MODES:
        results["refused"][(other, mode)] = group_refusal(
            lambda: [torch.nn.Parameter(torch.ones(8, device=dev))], offload=mode,
            process_group=group)
    # A group of rank 0 alone: the other ranks are refused as non-members.
    first = dist.new_group(ranks=[0])
    results["not_member"] = group_refusal(
        lambda: [torch.nn.Parameter(torch.ones(8, device=dev))], offload="none",
        process_group=first) if rank > 0 else None
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, f"{out_file}.{rank}")
    # Leave at once: gloo's threads can abort interpreter shutdown ("terminate called without
    # an active exception", seen twice on a loaded 2-vCPU VM), and every result is written.
    sys.stdout.flush()
    os._exit(0)


def run_sliced_processes(world, backend, world_size=None, timeout=300):
    """Runs sliced_worker on `world` processes; returns every rank's results."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tests_dir] + [p for p in sys.path if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        procs = [subprocess.Popen(
            [sys.executable, "-c", "import sys, test_torch_manager as t; "
             "t.sliced_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], "
             "sys.argv[5], int(sys.argv[6]) or None)",
             str(r), str(world), init_file, out, backend, str(world_size or 0)], env=env,
            cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
        logs = communicate_all(procs, timeout)
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def check_sliced_results(results, memory):
    """Every rank: the single-process bits in every mode, through the device callback
    communicator in modes none and optimizer and the host one in full; the group without
    a backend for `memory` refused naming 'process_group' (host memory: unless a GPU can
    stage it); a group without this rank refused naming it."""
    for r, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {r}: " + "; ".join(res["mismatches"])
        if r > 0:
            assert "not a member of 'process_group'" in res["not_member"], res["not_member"]
        assert res["comm"] == {"none": "device_callback", "optimizer": "device_callback",
                               "full": "callback"}, f"rank {r}: {res['comm']}"
        for (group, mode), message in res["refused"].items():
            what = f"rank {r}, {group} group, mode {mode}: {message!r}"
            if memory == "cuda" and mode != "full":
                assert "'process_group'" in message and "no CUDA backend" in message, what
            elif memory == "cuda" or torch.cuda.is_available():
                assert message == "", what  # full: host memory on the CPU backend; staged
            else:
                assert "'process_group'" in message and "cannot all-reduce cpu" in message, what


def test_two_gloo_processes_drive_the_device_memory_communicator_to_one_process_bits():
    """Two gloo processes on the host device, each holding uneven slices: modes none and
    optimizer through the device callback communicator (host memory: the code path of CUDA
    memory without the stream), full through the host one; norms, skipped steps (an Inf on
    the last rank only), params and moments equal one process's, bit for bit."""
    check_sliced_results(run_sliced_processes(2, "gloo"), "cpu")


def test_device_words_reduce_as_unsigned_through_signed_collectives(monkeypatch):
    """The device callback's words on two threads whose "collective" has
    torch.distributed.all_reduce's semantics (signed int64/int32 SUM, MAX, MIN): uint64
    and uint32 words combine as unsigned (top bits set included), floats as they are."""
    import threading

    import numpy as np

    from stepcore import _manager

    board, barrier = [None, None], threading.Barrier(2)
    torch_op = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}

    def signed_reducer(group, memory, stage_device=None):
        assert memory == torch.device("cpu") and stage_device is None
        rank = group

        def reduce(t, op):
            assert t.dtype in (torch.int64, torch.int32, torch.float64, torch.float32)
            board[rank] = t.clone()
            barrier.wait()
            combined = torch_op[op](board[0], board[1])
            barrier.wait()
            t.copy_(combined)
        return reduce

    monkeypatch.setattr(_manager, "_reducer", signed_reducer)
    fns = [_manager._device_all_reduce_function(r, torch.device("cpu"), None) for r in range(2)]
    cases = [
        (np.uint64, [[2**63 + 5, 1, 2**64 - 1, 7], [3, 2**63, 2**62, 2**64 - 2]]),
        (np.uint32, [[2**31 + 5, 1, 2**32 - 1], [3, 2**31, 2**30]]),
        (np.float64, [[1.5, -2.0, 3.0], [-1.0, 4.0, 0.25]]),
        (np.float32, [[1.5, -2.0], [-1.0, 4.0]]),
    ]
    numpy_op = {"sum": np.add, "max": np.maximum, "min": np.minimum}
    for dtype, (a, b) in cases:
        for op in ("sum", "max", "min"):
            arrays = [np.array(a, dtype=dtype), np.array(b, dtype=dtype)]
            want = numpy_op[op](arrays[0], arrays[1])  # uint64 sums wrap mod 2^64
            threads = [threading.Thread(target=fns[r], args=(arrays[r], op)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for r in range(2):
                assert arrays[r].tobytes() == want.tobytes(), (dtype, op, r, arrays[r], want)


def test_process_group_of_the_wrong_kind_is_refused_naming_it():
    for value in (42, "gloo", object()):
        with pytest.raises(TypeError, match="'process_group' must be a "
                                            "torch.distributed.ProcessGroup"):
            st.GradientManager(TinyLM(), offload="none", process_group=value)


@pytest.mark.parametrize("config, memory, cuda, want", [
    ("cpu:gloo,cuda:nccl", "cpu", False, "direct"),
    ("cpu:gloo,cuda:nccl", "cuda", False, "direct"),
    ("cuda:nccl", "cuda", False, "direct"),
    ("cuda:nccl", "cpu", True, "staged"),
    ("cuda:nccl", "cpu", False, "cannot all-reduce cpu memory"),
    ("cpu:gloo", "cuda", True, "no CUDA backend"),
])
def test_the_group_backend_serving_the_memory_reduces_it(monkeypatch, config, memory, cuda,
                                                          want):
    """_reducer's choice by the group's backends: the device type's own backend, host memory
    staged through a GPU when the group has only a CUDA one, else ValueError naming
    'process_group' (a CUDA memory without a CUDA backend, host memory without a GPU)."""
    import torch.distributed as dist

    from stepcore import _manager

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    if want in ("direct", "staged"):
        assert _manager._reducer(object(), torch.device(memory, 0) if memory == "cuda"
                                 else torch.device(memory)).__name__ == want
    else:
        with pytest.raises(ValueError, match=f"'process_group' \\(backends {config}\\).*{want}"):
            _manager._reducer(object(), torch.device(memory))


@pytest.mark.parametrize("config, backend, want", [
    ("cpu:gloo,cuda:nccl", None, {"cpu": "gloo", "cuda": "nccl"}),
    (None, "nccl", {"cuda": "nccl"}),
    (None, "gloo", {"cpu": "gloo", "cuda": "gloo"}),
    (None, "cuda:gloo", {"cuda": "gloo"}),
])
def test_a_groups_backends_by_device_type(monkeypatch, config, backend, want):
    """From get_backend_config, else (a group torch keeps no configuration for) from the
    backend's name and the device types it serves."""
    import torch.distributed as dist

    from stepcore import _manager

    def no_config(group=None):
        raise KeyError(group)

    monkeypatch.setattr(dist, "get_backend_config",
                        (lambda group=None: config) if config else no_config)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert _manager._group_backends(object()) == want


# ---- CUDA (label gpu: skips without a GPU) ---------------------------------------------


@pytest.mark.gpu
def test_cuda_parameters_give_the_same_bits_in_every_mode():
    """On CUDA parameters (the CUDA device on the caller's current stream): modes none and
    optimizer run the GPU kernels, full the CPU engine; all three agree after every step."""
    import stepcore

    if not torch.cuda.is_available() or not stepcore.gpu.built_with_cuda():
        pytest.skip("needs a CUDA GPU and stepcore built with CUDA "
                    f"({stepcore.gpu.unavailable_reason() or 'no GPU visible to torch'})")
    runs = {}
    for mode in MODES:
        model = TinyLM().cuda()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            gm = st.GradientManager(make_groups(model), offload=mode, lr=1e-2, betas=BETAS,
                                    weight_decay=WD, chunk_elements=300)
            sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
            recs = []
            for step in range(3):
                mbs = [(t.cuda(), y.cuda()) for t, y in micro_batches(step)]
                gm.begin_step(1.0 / tokens_of(mbs))
                for k, mb in enumerate(mbs):
                    gm.begin_backward(final_backward=k == len(mbs) - 1)
                    loss_sum(model, mb).backward()
                    gm.finish_backward()
                norm = gm.clip_grad_norm_(MAX_NORM)
                gm.step()
                sched.step()
                sd = gm.state_dict()["state"]
                recs.append(([bits(p.cpu()) for p in model.parameters()],
                             [(bits(sd[i]["exp_avg"].cpu()), bits(sd[i]["exp_avg_sq"].cpu()),
                               float(sd[i]["step"])) for i in range(len(sd))],
                             norm.item(), gm.report()["clip_coefficient"]))
            gm.close()
        runs[mode] = recs
    for mode in MODES[1:]:
        assert_records_equal(runs[mode], runs[MODES[0]], f"cuda {mode}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_cuda_backward_on_another_stream_is_ordered_by_the_write_event(mode):
    """The manager is built on the current stream; backward runs on a side stream whose
    gradient writes are held back by a sleep kernel. The hook's event (recorded on the side
    stream) orders the manager's reads after them, and the release events order the side
    stream's reuse after the reads: the bits of the run with backward on the manager's
    stream."""
    import stepcore

    if not torch.cuda.is_available() or not stepcore.gpu.built_with_cuda():
        pytest.skip("needs a CUDA GPU and stepcore built with CUDA "
                    f"({stepcore.gpu.unavailable_reason() or 'no GPU visible to torch'})")
    runs = {}
    for where in ("same", "side"):
        model = TinyLM().cuda()
        gm = st.GradientManager(make_groups(model), offload=mode, lr=1e-2, betas=BETAS,
                                weight_decay=WD, chunk_elements=300)
        side = torch.cuda.Stream()
        recs = []
        for step in range(2):
            mbs = [(t.cuda(), y.cuda()) for t, y in micro_batches(step)]
            gm.begin_step(1.0 / tokens_of(mbs))
            for k, mb in enumerate(mbs):
                gm.begin_backward(final_backward=k == len(mbs) - 1)
                if where == "side":
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(20_000_000)  # the writes land late
                        loss_sum(model, mb).backward()
                else:
                    loss_sum(model, mb).backward()
                gm.finish_backward()
            norm = gm.clip_grad_norm_(MAX_NORM)
            gm.step()
            sd = gm.state_dict()["state"]
            recs.append(([bits(p.cpu()) for p in model.parameters()],
                         [(bits(sd[i]["exp_avg"].cpu()), bits(sd[i]["exp_avg_sq"].cpu()),
                           float(sd[i]["step"])) for i in range(len(sd))],
                         norm.item(), gm.report()["clip_coefficient"]))
        torch.cuda.synchronize()
        gm.close()
        runs[where] = recs
    assert_records_equal(runs["side"], runs["same"], f"cuda {mode}: backward on a side stream")


# ---- every optimizer in every mode ---------------------------------------------------------

# (optimizer, hyper (the manager's other hyper-parameters), torch's class and arguments)
EVERY_OPTIMIZER = [
    ("adam", {"amsgrad": True}, "Adam", dict(betas=BETAS, eps=1e-8, amsgrad=True)),
    ("adamw", {"amsgrad": True, "maximize": True}, "AdamW",
     dict(betas=BETAS, eps=1e-8, amsgrad=True, maximize=True)),
    ("sgd", {}, "SGD", {}),
    ("sgd", {"momentum": 0.9, "nesterov": True}, "SGD", dict(momentum=0.9, nesterov=True)),
    ("adagrad", {"initial_accumulator_value": 0.1, "lr_decay": 0.01}, "Adagrad",
     dict(initial_accumulator_value=0.1, lr_decay=0.01)),
]


def train_pair(optimizer, hyper, cls, args, steps=4, offload="full"):
    """TinyLM trained by plain torch (cls(fused=True), the exact norm, torch's clip) and by
    a GradientManager in mode `offload`: per step each one's (params bits, {slot: bits}, step)."""
    def state_of(get, params, names):
        return [{n: bits(get(i, p, n)) for n in names} for i, p in enumerate(params)]

    model = TinyLM()
    groups = make_groups(model)
    for g in groups:
        g.pop("name")
    betas = {"betas": BETAS} if optimizer in ("adam", "adamw") else {}
    opt = getattr(torch.optim, cls)(groups, lr=1e-2, fused=True, **args)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    params = [p for g in opt.param_groups for p in g["params"]]
    want = []
    for step in range(steps):
        mbs = micro_batches(step)
        scale = torch.tensor(1.0 / tokens_of(mbs), dtype=torch.float32)
        for mb in mbs:
            loss_sum(model, mb).backward()
        with torch.no_grad():
            for p in params:
                p.grad.copy_(p.grad * scale)
            norm = f32(exact_norm([p.grad for p in params]))
            clip = float(torch.clamp(max_norm_at(step) / (torch.tensor(norm) + 1e-6), max=1.0))
            for p in params:
                p.grad.copy_(p.grad * torch.tensor(clip, dtype=torch.float32))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        names = [k for k, v in opt.state[params[0]].items() if k != "step" and v is not None]
        want.append(([bits(p) for p in params],
                     state_of(lambda i, p, n: opt.state[p][n], params, names)))

    model = TinyLM()
    gm = st.GradientManager(make_groups(model), offload=offload, optimizer=optimizer, lr=1e-2,
                            hyper=hyper, threads=2, **betas)
    sched = torch.optim.lr_scheduler.LambdaLR(gm, schedule)
    got = []
    try:
        for step in range(steps):
            drive(gm, model, sched, step, False)
            sd = gm.state_dict()["state"]
            mine = [p for g in gm.param_groups for p in g["params"]]
            names = [k for k in sd[0] if k not in ("step", "master")]
            got.append(([bits(p) for p in mine],
                        state_of(lambda i, p, n: sd[i][n], mine, names)))
    finally:
        gm.close()
    return got, want


@pytest.mark.parametrize("offload", ["none", "optimizer", "full"])
@pytest.mark.parametrize("optimizer,hyper,cls,args", EVERY_OPTIMIZER,
                         ids=[f"{c[0]}-{'-'.join(sorted(c[1])) or 'plain'}" for c in EVERY_OPTIMIZER])
def test_every_optimizer_in_every_mode_gives_torchs_fused_bits(optimizer, hyper, cls, args,
                                                                offload):
    """Every mode steps every optimizer: params and every state slot (named as torch names
    it) equal torch's fused optimizer's after every step, clipped or not, scheduled."""
    got, want = train_pair(optimizer, hyper, cls, args, offload=offload)
    for s, ((gp, gs), (wp, ws)) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(gp, wp)):
            assert torch.equal(a, b), f"{optimizer} step {s} param {i}"
        for i, (a, b) in enumerate(zip(gs, ws)):
            assert sorted(a) == sorted(b), (s, i, sorted(a), sorted(b))
            for name in a:
                assert torch.equal(a[name], b[name]), f"{optimizer} step {s} param {i} {name}"
