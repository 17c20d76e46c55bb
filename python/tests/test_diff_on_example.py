"""stepcore.diff on stepcore itself: examples/train_tiny_lm.py --record, then the comparer.

The example (3 steps, a small model) records every run through the GradientManager's
`recorder=` hook (and the torch baseline through explicit record calls). Modes none and
full must compare identical (exit 0); formula native against formula torch must diverge
at step 1 in an exp_avg tensor, the first tensor the hook records after the clip point,
with ulp figures. The recorded tensors themselves are checked against the example's own
per-step bit digests (params, exp_avg, exp_avg_sq, step) and norm bits.
"""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the tiny LM example needs PyTorch")
pytest.importorskip("stepcore.torch")

import stepcore  # noqa: E402
import stepcore.diff as sd  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(stepcore._core, "diff_compare"),
                                reason="stepcore._core was built without the comparer")

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
sys.path.insert(0, os.path.abspath(EXAMPLES))

import train_tiny_lm as lm  # noqa: E402

SMALL = ["--steps", "3", "--warmup", "2", "--vocab", "256", "--dim", "32",
         "--micro-batches", "2", "--quiet"]


def _env():
    """The subprocess environment: this test's import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def diff_json(a, b):
    """Runs python -m stepcore.diff A B --json; returns (exit status, parsed JSON)."""
    p = subprocess.run([sys.executable, "-m", "stepcore.diff", str(a), str(b), "--json"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, json.loads(p.stdout)


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    """The example run twice with --record: formula torch and formula native."""
    out = {}
    for formula in ("torch", "native"):
        d = tmp_path_factory.mktemp(f"rec-{formula}")
        p = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_tiny_lm.py"), *SMALL,
                            "--formula", formula, "--record", str(d)],
                           capture_output=True, text=True, env=_env(), timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        out[formula] = d
    return out


def test_the_example_records_every_run(recordings):
    """DIR/<run tag>/ for the baseline and the six stepcore runs, with the run metadata."""
    d = recordings["torch"]
    assert sorted(os.listdir(d)) == sorted(
        ["torch"] + [f"stepcore-{m}{o}" for m in lm.MODES for o in ("", "-overlap")])
    r = sd.read_recording(d / "stepcore-full")
    assert (r.run["offload"], r.run["formula"], r.run["device"], r.run["run_tag"]) == \
        ("full", "torch", "cpu", "stepcore-full")
    assert {e["step"] for e in r.entries} == {1, 2, 3}


def test_modes_none_and_full_compare_identical(recordings):
    """Mode none against mode full (clipped, and with overlap), and each overlapped run
    against its non-overlapped run: exit 0, every tensor identical."""
    d = recordings["torch"]
    for a, b in (("stepcore-none", "stepcore-full"),
                 ("stepcore-none-overlap", "stepcore-full-overlap"),
                 ("stepcore-none", "stepcore-none-overlap"),
                 ("stepcore-full", "stepcore-full-overlap")):
        rc, r = diff_json(d / a, d / b)
        assert rc == 0 and r["identical"] is True, (a, b, r["first_divergence"])
        assert r["summary"]["identical"] == r["summary"]["tensors"] > 0


def test_native_against_torch_diverges_at_step_1_in_exp_avg(recordings):
    """native vs torch: step 1's norm and clip agree, exp_avg/tok.weight differs in ulps."""
    rc, r = diff_json(recordings["native"] / "stepcore-none", recordings["torch"] / "stepcore-none")
    assert rc == 1 and r["exit_status"] == 1
    fd = r["first_divergence"]
    assert (fd["step"], fd["point"], fd["rank"]) == (1, "after_step", 0), fd
    assert fd["name"].startswith("exp_avg/"), fd
    first = next(t for t in r["tensors"] if t["status"] != "identical")
    assert [(t["point"], t["name"], t["status"]) for t in r["tensors"][:2]] == \
        [("clip", "norm", "identical"), ("clip", "clip_coefficient", "identical")]
    assert first["name"] == fd["name"] == "exp_avg/tok.weight"
    assert first["max_ulps"] > 0 and first["median_ulps"] > 0, first
    assert first["median_ulps"] <= first["max_ulps"]
    assert 0 < first["differing"] <= first["elements"]
    print(f"\nnative vs torch, step 1 {first['name']}: {first['differing']} of "
          f"{first['elements']} differ, max {first['max_ulps']} ulps, median "
          f"{first['median_ulps']}")


def test_the_hook_records_in_the_documented_order(recordings):
    """Step 1: clip/norm, clip/clip_coefficient, then each kind for every parameter."""
    # kinds exp_avg, exp_avg_sq, step, master, param; the model's names; overlap runs
    # call clip_grad_norm_ too, so they have the clip point
    args = lm.parse_args(SMALL)
    names = [n for n, _ in lm.build_model(args).named_parameters()]
    want = [("clip", "norm"), ("clip", "clip_coefficient")] + [
        ("after_step", f"{k}/{n}") for k in ("exp_avg", "exp_avg_sq", "step", "master", "param")
        for n in names]
    for tag in ("stepcore-optimizer", "torch", "stepcore-none-overlap"):
        r = sd.read_recording(recordings["torch"] / tag)
        got = [(e["point"], e["name"]) for e in r.entries if e["step"] == 1]
        assert got == want, tag


@pytest.fixture
def torch_settings():
    """Restores the global RNG, deterministic mode and thread count the example changes."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    with torch.random.fork_rng():
        yield
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_recorded_tensors_are_the_runs_bits(tmp_path, torch_settings, offload):
    """A run's recording holds the bits of the run's own per-step digests and norms."""
    # params, exp_avg, exp_avg_sq, step (master == param for f32 params), the norm bits,
    # and the final params the run returns
    args = lm.parse_args(SMALL + ["--record", str(tmp_path)])
    lm.setup_determinism(args, args.torch_threads)
    runs = {"torch": lm.run_torch(args, show=False),
            f"stepcore-{offload}": lm.run_stepcore(args, offload, False, show=False)}
    names = [n for n, _ in lm.build_model(args).named_parameters()]
    for tag, (records, final) in runs.items():
        r = sd.read_recording(tmp_path / tag)
        for step, rec in enumerate(records, start=1):
            def recorded(kind):
                """The recorded tensors of `kind` at this step, as torch tensors."""
                return [torch.from_numpy(r.get(step, "after_step", f"{kind}/{n}").copy())
                        for n in names]
            for kind in ("exp_avg", "exp_avg_sq", "step"):
                assert lm.digest(recorded(kind)) == rec["digests"][kind], (tag, step, kind)
            assert lm.digest(recorded("param")) == rec["digests"]["params"], (tag, step)
            assert lm.digest(recorded("master")) == rec["digests"]["params"], (tag, step)
            norm = r.get(step, "clip", "norm")
            assert int(norm.view("<i4")) == rec["norm_bits"], (tag, step)
        last = [torch.from_numpy(r.get(len(records), "after_step", f"param/{n}").copy())
                for n in names]
        assert all(torch.equal(lm.bits(a), lm.bits(b)) for a, b in zip(last, final)), tag


def test_the_hook_with_sign_sgd_and_no_clip(tmp_path):
    """SignSGD, no clip_grad_norm_: master and param only, p - 0.1·sign(g) rounded once."""
    import stepcore.torch as st

    g = torch.Generator().manual_seed(3)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(TypeError, match="'recorder' must be a stepcore.diff.Recorder"):
        st.GradientManager(model, offload="none", recorder="runs/x")
    rec = sd.Recorder(tmp_path / "s")
    gm = st.GradientManager(model, offload="optimizer", optimizer="sign_sgd", lr=0.1,
                            threads=1, recorder=rec)
    try:
        gm.begin_step(1.0)
        gm.begin_backward(final_backward=True)
        x = torch.randn(4, 3, generator=g)
        model(x).square().sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}  # None: handed over
        gm.finish_backward()
        gm.step()
    finally:
        gm.close()
    assert all(v is None for v in grads.values())
    assert rec.step == 2  # the manager's step ended the recorder's step
    rec.close()
    r = sd.read_recording(tmp_path / "s")
    assert [(e["point"], e["name"]) for e in r.entries] == [
        ("after_step", "master/weight"), ("after_step", "master/bias"),
        ("after_step", "param/weight"), ("after_step", "param/bias")]
    assert (r.run["optimizer"], r.run["formula"], r.run["offload"]) == \
        ("sign_sgd", None, "optimizer")
    # the gradient of sum((Wx + b)^2), by hand: dW = 2 (Wx + b)^T x, db = 2 sum(Wx + b)
    w, b = before["weight"], before["bias"]
    y = x @ w.t() + b
    want = {"weight": w - torch.sign(2 * y.t() @ x) * torch.tensor(0.1),
            "bias": b - torch.sign(2 * y.sum(0)) * torch.tensor(0.1)}
    for n, p in model.named_parameters():
        got = r.get(1, "after_step", f"param/{n}")
        assert got.tobytes() == p.detach().numpy().tobytes(), n
        assert got.tobytes() == want[n].numpy().tobytes(), n
        assert r.get(1, "after_step", f"master/{n}").tobytes() == got.tobytes(), n
