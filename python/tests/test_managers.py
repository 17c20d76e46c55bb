"""The gradient managers from Python (stepcore._core.GradientManager on the host device):
the three offload modes give the same bits, equal to torch's fused AdamW (and in mode full
Adam, SGD and Adagrad, their state slots by name) fed the manager's gradient read (an
independent expectation), also on two in-process ranks and
with overlap (speculated chunks committed or rolled back); the trainer's own gradient
buffers, groups and schedules, checkpoints across modes; bad input named."""

import threading
from fractions import Fraction

import numpy as np
import pytest

import stepcore._core as core

MODES = ("none", "optimizer", "full")
SIZES = (33, 1, 0, 1025, 300)


def specs(grad_dtype="f32", gradient_buffer=True):
    return [{"name": f"p{i}", "numel": n, "grad_dtype": grad_dtype, "group": i % 2,
             "gradient_buffer": gradient_buffer} for i, n in enumerate(SIZES)]


GROUPS = [{"name": "decay", "lr": 1e-3, "weight_decay": 0.1},
          {"name": "no_decay", "lr": 2e-3, "weight_decay": 0.0}]


def master(i, n):
    return (np.sin(np.arange(n, dtype=np.float64) * 0.37 + i) * 0.05).astype(np.float32)


def grad(step, micro, i, n):
    x = np.cos(np.arange(n, dtype=np.float64) * (0.11 + 0.01 * i) + step * 1.7 + micro)
    return (x * 2.0 ** -(i % 4)).astype(np.float32)


def lr_at(step, g):
    return (1e-3 if g == 0 else 2e-3) * (0.5 + 0.5 * np.cos(step * 0.3))


def run(mode, steps=4, max_norm=0.5, caller=False, comm=None, shard=None, save=None, load=None,
        first=0, overlap=False, reports=None, **kw):
    """Drives a manager through `steps` steps of 2 micro-batches; returns per step the norm
    and every parameter's (master, {slot: state}, compute bytes, step). max_norm may be a
    list (one per step); `reports` collects each step's report()."""
    m = core.GradientManager(mode, specs(gradient_buffer=not caller) if shard is None else shard[0],
                             groups=GROUPS, threads=2, chunk_elements=1000, comm=comm,
                             layout_fingerprint=7, **kw)
    sizes = SIZES if shard is None else [p["numel"] for p in shard[0]]
    offs = [0] * len(SIZES) if shard is None else shard[1]
    for i, n in enumerate(sizes):
        m.load_parameter(i, master(i, SIZES[i])[offs[i]:offs[i] + n])
    if load:
        m.load_checkpoint(load)
    out = []
    for s in range(first, first + steps):
        for g in range(2):
            m.set_hyperparameters(g, lr_at(s, g), GROUPS[g]["weight_decay"])
        m.begin_step(1.0 / (100 + s), overlap)
        for mb in range(2):
            m.begin_backward(mb == 1)
            for i in reversed(range(len(sizes))):
                gi = grad(s, mb, i, SIZES[i])[offs[i]:offs[i] + sizes[i]]
                if caller:  # the trainer's buffer: alive until the manager releases it
                    buf = gi.copy()
                    m.gradient_ready(i, buf)
                    m.gradient_released_wait(i)
                    buf[:] = np.nan  # released: rewriting it must change nothing
                else:
                    np.from_dlpack(m.gradient(i))[:] = gi
                    m.gradient_ready(i)
            m.finish_backward()
        norm = m.clip_grad_norm(max_norm[s - first] if isinstance(max_norm, list) else max_norm)
        m.step()
        rep = m.report()
        if reports is not None:
            reports.append(rep)
        state = [m.read_parameter(i) + (m.step_count(i),) for i in range(len(sizes))]
        out.append((norm, state))
    if save:
        m.save_checkpoint(save)
    m.close()
    return out


def same(a, b):
    assert len(a) == len(b)
    for (na, sa), (nb, sb) in zip(a, b):
        assert np.float32(na).tobytes() == np.float32(nb).tobytes()
        for pa, pb in zip(sa, sb):
            assert pa[0].tobytes() == pb[0].tobytes()
            assert sorted(pa[1]) == sorted(pb[1])
            for name in pa[1]:
                assert pa[1][name].tobytes() == pb[1][name].tobytes(), name
            assert pa[2] == pb[2] and pa[3] == pb[3]


def test_the_three_modes_give_the_same_bits_and_the_trainers_buffers_too():
    want = run("none")
    for mode in MODES:
        same(run(mode), want)
        same(run(mode, caller=True), want)


@pytest.mark.parametrize("speculation", ["always", "never", "auto"])
@pytest.mark.parametrize("mode", MODES)
def test_overlapped_steps_with_clipping_give_the_same_bits(mode, speculation):
    """begin_step(s, True) then clip_grad_norm: clipped steps roll the speculated chunks
    back and step them again, unclipped ones commit them; the bits are those of the same
    steps without overlap."""
    norms = [n for n, _ in run("none", max_norm=1e9)]
    max_norms = [norms[0] / 2, 1e9, 1e9, norms[3] / 2]  # clipped, not, not, clipped
    want = run("none", max_norm=max_norms)
    reports = []
    same(run(mode, max_norm=max_norms, overlap=True, reports=reports,
             speculation=speculation), want)
    for s, rep in enumerate(reports):
        spec = rep["chunks_speculated"]
        assert rep["chunks_committed"] + rep["chunks_rolled_back"] == spec, (s, rep)
        assert (rep["clip_coefficient"] < 1) == (s in (0, 3)), (s, rep)
        # auto: speculates at the first step and after a committed one: waits at step 1
        if speculation == "never" or (speculation == "auto" and s == 1):
            assert spec == 0, (s, rep)
            continue
        assert spec > 0, (s, rep)
        assert rep["chunks_rolled_back" if s in (0, 3) else "chunks_committed"] == spec, (s, rep)


# (optimizer, the manager's hyper-parameters, torch's optimizer class name and arguments)
TORCH_CASES = [
    ("adamw", {}, "AdamW", dict(betas=(0.9, 0.999), eps=1e-8)),
    ("adamw", {"amsgrad": True, "maximize": True}, "AdamW",
     dict(betas=(0.9, 0.999), eps=1e-8, amsgrad=True, maximize=True)),
    ("adam", {"amsgrad": True}, "Adam", dict(betas=(0.9, 0.999), eps=1e-8, amsgrad=True)),
    ("sgd", {}, "SGD", {}),
    ("sgd", {"momentum": 0.9, "dampening": 0.1}, "SGD", dict(momentum=0.9, dampening=0.1)),
    ("sgd", {"momentum": 0.5, "nesterov": True}, "SGD", dict(momentum=0.5, nesterov=True)),
    ("adagrad", {"initial_accumulator_value": 0.1, "lr_decay": 0.01}, "Adagrad",
     dict(initial_accumulator_value=0.1, lr_decay=0.01)),
]


@pytest.mark.parametrize("optimizer,hyper,cls,args", TORCH_CASES,
                         ids=[f"{c[0]}{sorted(c[1])}" for c in TORCH_CASES])
def test_the_manager_equals_torch_fused_fed_its_gradient_read(optimizer, hyper, cls, args):
    """Mode full, and modes none and optimizer for plain AdamW (every mode steps every
    optimizer: test_optimizer_table.py runs them all), against torch's fused optimizer:
    every slot by torch's name for it, the step counter, each step."""
    torch = pytest.importorskip("torch")
    modes = ["full"] + (["none", "optimizer"] if optimizer == "adamw" and not hyper else [])
    for mode in modes:
        torch_fused_case(torch, mode, optimizer, hyper, cls, args)


def torch_fused_case(torch, mode, optimizer, hyper, cls, args):
    got = run(mode, steps=3, optimizer=optimizer, hyper=hyper)
    params = [torch.nn.Parameter(torch.from_numpy(master(i, n))) for i, n in enumerate(SIZES)]
    groups = [{"params": [p for i, p in enumerate(params) if i % 2 == g], **GROUPS[g]}
              for g in range(2)]
    for grp in groups:
        grp.pop("name")
    opt = getattr(torch.optim, cls)(groups, fused=True, **args)
    for s in range(3):
        accs = []
        for i, n in enumerate(SIZES):
            acc = torch.from_numpy(grad(s, 0, i, n)).clone()
            acc += torch.from_numpy(grad(s, 1, i, n))  # copy, then add, in f32
            accs.append(acc)
        scale = np.float32(1.0 / (100 + s))
        x = [a * torch.tensor(scale) for a in accs]  # R(acc * s)
        # The exact norm of the read values (Fractions), rounded once to f32.
        s2 = sum(Fraction(float(v)) ** 2 for t in x for v in t.tolist())
        norm = np.float32(got[s][0])
        # Correctly rounded: sqrt(s2) lies within half an ulp of norm, i.e. between the
        # squares of the midpoints to its f32 neighbours.
        lo = (Fraction(float(norm)) + Fraction(float(np.nextafter(norm, np.float32(0))))) / 2
        hi = (Fraction(float(norm)) + Fraction(float(np.nextafter(norm, np.float32(1e30))))) / 2
        assert lo * lo <= s2 <= hi * hi, (s, float(norm))
        clip = core.clip_coefficient(norm, 0.5)
        for g in range(2):
            opt.param_groups[g]["lr"] = lr_at(s, g)
        for p, xi in zip(params, x):
            p.grad = xi * torch.tensor(np.float32(clip))  # R(R(acc * s) * c)
        opt.step()
        for i, p in enumerate(params):
            st = opt.state[p]
            mine = got[s][1][i]
            assert mine[0].tobytes() == p.detach().numpy().tobytes(), (s, i)
            for name, value in mine[1].items():  # torch's names for the state
                assert value.tobytes() == st[name].numpy().tobytes(), (s, i, name)
            assert sorted(mine[1]) == sorted(k for k, v in st.items()
                                             if k != "step" and v is not None), (s, i)
            if "step" in st:
                assert mine[3] == st["step"].item()


def test_state_slots_are_named_and_imported_by_name():
    m = core.GradientManager("full", specs(), optimizer="sgd", hyper={"momentum": 0.9},
                             groups=GROUPS, threads=1)
    assert m.state_slot_names == ["momentum_buffer"] and m.counts_steps
    n = SIZES[0]
    buf = np.linspace(-1, 1, n, dtype=np.float32)
    m.import_parameter(0, master(0, n), {"momentum_buffer": buf}, 3.0)
    got_master, slots, _ = m.read_parameter(0)
    assert list(slots) == ["momentum_buffer"] and slots["momentum_buffer"].tobytes() == buf.tobytes()
    view_master, views = m.host_state(0)
    assert np.from_dlpack(views["momentum_buffer"]).tobytes() == buf.tobytes()
    assert m.step_count(0) == 3.0
    with pytest.raises(ValueError, match="momentum_buffer"):
        m.import_parameter(0, master(0, n), {"exp_avg": buf}, 3.0)
    with pytest.raises(ValueError, match="momentum_buffer"):
        m.import_parameter(0, master(0, n), {}, 3.0)
    with pytest.raises(ValueError, match="sgd.nesterov_"):
        core.GradientManager("full", specs(), optimizer="sgd", hyper={"nesterov_": True})
    with pytest.raises(ValueError, match="sgd.nesterov"):
        core.GradientManager("full", specs(), optimizer="sgd", hyper={"nesterov": 0.5})
    with pytest.raises(ValueError, match="optimizer"):
        core.GradientManager("full", specs(), optimizer="muon")
    m.close()


def test_two_in_process_ranks_give_the_whole_models_norms():
    whole = run("none")
    comms = core.make_in_process_group(2, 30.0)
    # Rank r holds elements [off, off + len) of every parameter (rank 0's first share empty).
    shards = []
    for r in range(2):
        sp, offs = [], []
        for i, n in enumerate(SIZES):
            cut = 0 if i == 0 else n // 3
            off, ln = (0, cut) if r == 0 else (cut, n - cut)
            sp.append({"name": f"p{i}", "numel": ln, "grad_dtype": "f32", "group": i % 2})
            offs.append(off)
        shards.append((sp, offs))
    results, errors = [None, None], [None, None]

    def rank(r):
        try:
            results[r] = run("full", comm=comms[r], shard=shards[r])
        except Exception as e:  # pragma: no cover - reported below
            errors[r] = e
            comms[r].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [None, None]
    for r in range(2):
        for (nw, _), (nr, _) in zip(whole, results[r]):
            assert np.float32(nw).tobytes() == np.float32(nr).tobytes()  # exact global norm


def test_a_checkpoint_saved_in_one_mode_resumes_in_another(tmp_path):
    want = run("none", steps=6)
    path = str(tmp_path / "rank-00000.stepcore")
    for a, b in (("full", "none"), ("none", "optimizer"), ("optimizer", "full")):
        same(run(a, steps=3, save=path), want[:3])
        same(run(b, steps=3, load=path, first=3), want[3:])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="fsdp"):
        core.GradientManager("fsdp", specs())
    with pytest.raises(ValueError, match=r"params\[0\].numels"):
        core.GradientManager("full", [{"name": "w", "numels": 3}])
    with pytest.raises(TypeError, match=r"params\[0\].grad_dtype"):
        core.GradientManager("full", [{"name": "w", "numel": 3, "grad_dtype": "f64"}])
    with pytest.raises(ValueError, match=r"groups\[1\].lr"):
        core.GradientManager("full", specs(), groups=[GROUPS[0], {**GROUPS[1], "lr": -1.0}])
    with pytest.raises(ValueError, match="device"):
        core.GradientManager("full", specs(), device="tpu")
    with pytest.raises(ValueError, match="speculation"):
        core.GradientManager("full", specs(), speculation="sometimes")
    with pytest.raises(ValueError, match="speculation_bytes"):
        core.GradientManager("none", specs(), speculation_bytes=-2)
    with pytest.raises(ValueError, match="speculation_device_bytes"):
        core.GradientManager("full", specs(), speculation_device_bytes=-2)
    with pytest.raises(ValueError, match="speculation_device_bytes"):
        core.GradientManager("optimizer", specs(), speculation_device_bytes=-1)
    m = core.GradientManager("full", specs(gradient_buffer=False), groups=GROUPS, threads=1)
    m.begin_step(1.0)
    m.begin_backward(True)
    with pytest.raises(ValueError, match="'grad'"):
        m.gradient_ready(0, np.zeros(32, np.float32))  # 33 elements expected
    with pytest.raises(TypeError, match="'grad'"):
        m.gradient_ready(0, np.zeros(33, np.float64))
    with pytest.raises(ValueError, match="gradient"):
        m.gradient(0)  # no manager buffer
    with pytest.raises(ValueError, match="hyper.lr"):
        m.set_hyperparameters(0, float("nan"), 0.0)
    m.close()


def test_placement_and_launcher_environment(monkeypatch):
    p = core.numa_place_on_node(0, 0, 1)
    assert p["threads"] >= 1 and len(p["cpus"]) == p["threads"]
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert core.local_rank_from_env() == 3


def board_callbacks(view, calls=None):
    """Two ranks' all_reduce(array, op) callbacks over a shared board (what
    torch.distributed.all_reduce does over gloo): each reduces view(array) in place with the
    other rank's; rank 0 logs (dtype, size, op) into `calls`."""
    arrays, barrier = [None, None], threading.Barrier(2)

    def make(rank):
        def all_reduce(array, op):
            a = view(array)
            if calls is not None and rank == 0:
                calls.append((a.dtype.name, a.size, op))
            arrays[rank] = a.copy()
            barrier.wait()
            combined = arrays[0] + arrays[1] if op == "sum" else np.maximum(*arrays)
            barrier.wait()
            a[:] = combined
        return all_reduce

    return [make(r) for r in range(2)]


# Two ranks' halves of every parameter: (specs, offsets) per rank.
HALVES = [([{**s, "numel": (n // 2 if r == 0 else n - n // 2)} for s, n in zip(specs(), SIZES)],
           [0] * len(SIZES) if r == 0 else [n // 2 for n in SIZES]) for r in range(2)]


def run_two_ranks(mode, comms, **kw):
    """Runs `mode` on two threads, rank r over comms[r] with HALVES[r]; returns their runs."""
    got = [None, None]

    def rank(r):
        got[r] = run(mode, comm=comms[r], shard=HALVES[r], **kw)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def int64_words(array):
    """The host callback's words: int64 numpy arrays, reduced as they are."""
    assert array.dtype == np.int64
    return array


def test_callback_communicator_combines_partials_exactly_across_threads():
    """Two ranks in two threads, their collectives through Python callbacks over a shared
    board (what torch.distributed.all_reduce does over gloo): the whole model's norms."""
    comms = [core.make_callback_communicator(r, 2, f) for r, f in
             enumerate(board_callbacks(int64_words))]
    whole = run("full", steps=2)
    got = run_two_ranks("full", comms, steps=2)
    for r in range(2):
        for (n_whole, _), (n_rank, _) in zip(whole, got[r]):
            assert np.float32(n_whole).tobytes() == np.float32(n_rank).tobytes()


def final_backward_begun(mode, comm):
    """A manager in `mode` over `comm` whose final backward has every gradient handed over."""
    m = core.GradientManager(mode, specs(), groups=GROUPS, threads=1, comm=comm)
    for i, n in enumerate(SIZES):
        m.load_parameter(i, master(i, n))
    m.begin_step(0.01)
    m.begin_backward(True)
    for i, n in enumerate(SIZES):
        np.from_dlpack(m.gradient(i))[:] = grad(0, 0, i, n)
        m.gradient_ready(i)
    return m


def test_callback_communicator_that_raises_fails_the_manager():
    """A collective whose callback raises: Errc comm_error naming 'comm', and every later
    collective of that communicator raises at once."""
    calls = []

    def broken(array, op):
        calls.append(op)
        raise ConnectionError("peer went away")

    m = final_backward_begun("full", core.make_callback_communicator(0, 2, broken))
    m.finish_backward()
    with pytest.raises(RuntimeError, match=r"comm_error in 'comm'.*ConnectionError: peer went away"):
        m.clip_grad_norm(1.0)
    with pytest.raises(RuntimeError):
        m.step()
    try:
        m.close()
    except RuntimeError:
        pass  # close() may re-raise the step's failure once
    assert len(calls) == 1
    with pytest.raises(ValueError, match="rank"):
        core.make_callback_communicator(2, 2, broken)
    with pytest.raises(ValueError, match="all_reduce"):
        core.make_callback_communicator(0, 2, 42)


def test_device_callback_communicator_hands_the_words_in_place_for_the_whole_models_bits():
    """Modes none and optimizer on the host device, two ranks in two threads through a
    device callback communicator over a shared board: the callback gets the manager's own
    words (uint64 sums, the uint32 max pair, the uint64 layout check), reduces them in
    place, and every rank's shards get the whole model's norms and bits."""
    native = {"formula": "native"}  # torch's has a tail of numel % 8: the shards' differ
    for mode in ("none", "optimizer"):
        whole = run(mode, steps=3, hyper=native)
        calls = []
        # np.from_dlpack: a view, so the reduction lands in the manager's words.
        comms = [core.make_device_callback_communicator(r, 2, f) for r, f in
                 enumerate(board_callbacks(np.from_dlpack, calls))]
        assert [c.name for c in comms] == ["device_callback"] * 2
        got = run_two_ranks(mode, comms, steps=3, hyper=native)
        partial = [("uint64", 22, "sum"), ("uint32", 2, "max"), ("uint64", 3, "max")]
        assert calls[:3] == partial, calls
        for r, (shard, offsets) in enumerate(HALVES):
            for s, ((nw, sw), (nr, sr)) in enumerate(zip(whole, got[r])):
                assert np.float32(nw).tobytes() == np.float32(nr).tobytes(), (mode, s)
                for i, (pw, pr) in enumerate(zip(sw, sr)):
                    lo, hi = offsets[i], offsets[i] + shard[i]["numel"]
                    assert pw[0][lo:hi].tobytes() == pr[0].tobytes(), (mode, s, i)
                    for slot in pw[1]:
                        assert pw[1][slot][lo:hi].tobytes() == pr[1][slot].tobytes(), slot
                    assert pw[3] == pr[3]


def test_device_callback_communicator_arguments_and_its_memory_are_checked():
    """Named refusals: rank, size, all_reduce, device, a stream on the host device or none
    on a CUDA device; a CUDA-memory communicator is refused by mode full and by the host
    device (before any CUDA call); a raising callback fails the manager (comm_error)."""
    ok = lambda array, op: None  # noqa: E731
    with pytest.raises(ValueError, match="'rank'"):
        core.make_device_callback_communicator(2, 2, ok)
    with pytest.raises(ValueError, match="'size'"):
        core.make_device_callback_communicator(0, 0, ok)
    with pytest.raises(ValueError, match="'all_reduce'"):
        core.make_device_callback_communicator(0, 2, 42)
    for device in ("tpu", "cuda:", "cuda:x", "cuda:-1", "cuda"):
        with pytest.raises(ValueError, match="'device'"):
            core.make_device_callback_communicator(0, 2, ok, device=device)
    with pytest.raises(ValueError, match="'stream'.*host device has no streams"):
        core.make_device_callback_communicator(0, 2, ok, device="host", stream=0x1234)
    with pytest.raises(ValueError, match="'stream'.*compute stream"):
        core.make_device_callback_communicator(0, 2, ok, device="cuda:0")
    cuda = core.make_device_callback_communicator(0, 2, ok, device="cuda:0", stream=0x1234)
    for mode, why in (("full", "full offload reduces host memory"),
                      ("none", "a host communicator on the host device")):
        with pytest.raises(ValueError, match=f"'comm'.*device_callback.*{why}"):
            core.GradientManager(mode, specs(), groups=GROUPS, threads=1, comm=cuda)
    with pytest.raises(ValueError, match="'device'"):
        core.GradientManager("none", specs(), device="cuda:x")

    def broken(array, op):
        raise ConnectionError("peer went away")

    m = final_backward_begun("none", core.make_device_callback_communicator(0, 2, broken))
    # Mode none computes and reduces the partial as the final backward finishes.
    with pytest.raises(RuntimeError, match=r"comm_error in 'comm'.*ConnectionError: peer went away"):
        m.finish_backward()
    try:
        m.close()
    except RuntimeError:
        pass  # close() may re-raise the step's failure once
