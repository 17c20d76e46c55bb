"""Tests of examples/train_tiny_lm.py: its plain-PyTorch baseline and its stepcore runs.

The baseline is the reference the example compares stepcore's GradientManager against, so
it must learn (the loss falls by a clear margin in a few steps), be deterministic (two
runs give the same bits) and be quick; its batches must have what the example claims:
uneven micro-batches whose padding does not count as loss tokens. The example itself must
report the three offload modes bitwise identical (with and without overlap), each mode's
overlapped run (clipped, its speculated chunks committed or rolled back) identical to its
non-overlapped run, and on 2 FSDP2 processes identical to the 1-process run.
"""

import math
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="the tiny LM example needs PyTorch")

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
sys.path.insert(0, os.path.abspath(EXAMPLES))

import tiny_corpus  # noqa: E402
import train_tiny_lm as lm  # noqa: E402


@pytest.fixture
def torch_settings():
    """Restores the global RNG, deterministic mode and thread count the example changes."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    with torch.random.fork_rng():
        yield
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)


def baseline(argv):
    """Runs the baseline quietly with the example's determinism settings; returns (records, params, seconds)."""
    args = lm.parse_args(argv)
    lm.setup_determinism(args, args.torch_threads)
    start = time.perf_counter()
    records, params = lm.run_torch(args, show=False)
    return records, params, time.perf_counter() - start


def test_loss_falls_by_a_clear_margin_within_seconds(torch_settings):
    """12 steps take the loss from about ln(2048) = 7.6 to well below 6, in under 20 s."""
    records, _, seconds = baseline(["--steps", "12", "--warmup", "3"])
    losses = [r["loss"] for r in records]
    assert len(losses) == 12
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[0] > 7.0, losses
    assert losses[-1] < losses[0] - 1.5, losses
    assert seconds < 20.0, f"baseline took {seconds:.1f} s"
    assert records[0]["lr"] < records[2]["lr"]  # warm-up
    assert records[-1]["lr"] < records[3]["lr"]  # cosine decay


def test_two_runs_give_the_same_bits(torch_settings):
    """Same seed, same params, moments, norms and losses (compared as bits, not with tolerance)."""
    a, pa, _ = baseline(["--steps", "3"])
    b, pb, _ = baseline(["--steps", "3"])
    assert [r["digests"] for r in a] == [r["digests"] for r in b]
    assert [r["norm_bits"] for r in a] == [r["norm_bits"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    for x, y in zip(pa, pb):
        assert torch.equal(lm.bits(x), lm.bits(y))


def test_micro_batches_are_uneven_and_padding_is_not_counted():
    """Each step's micro-batches differ in rows/lengths; tokens count exactly the non-PAD targets."""
    steps = tiny_corpus.make_steps(4, 3, vocab=2048, context=64, rows=6, seed=0)
    assert any(mb.tokens < mb.targets.numel() for mbs in steps for mb in mbs)  # some padding
    for mbs in steps:
        assert len({mb.tokens for mb in mbs}) > 1
        for mb in mbs:
            assert mb.inputs.shape == mb.targets.shape and mb.inputs.shape[1] <= 64
            assert mb.tokens == int((mb.targets != tiny_corpus.PAD).sum())
            assert bool((mb.inputs[:, 0] == tiny_corpus.BOS).all())
        # the data-parallel split keeps every token exactly once
        assert sum(mb.rows(0, 2).tokens + mb.rows(1, 2).tokens for mb in mbs) == \
            lm.step_tokens(mbs)


def run_example(argv, timeout=600, script="train_tiny_lm.py"):
    """Runs the example in a subprocess (it sets torch's global state); returns (rc, output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *argv],
                          env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_the_example_reports_the_three_modes_bitwise_identical():
    """examples/README.md's `bitwise:` lines, from the example itself (6 steps). With
    --speculation always every overlapped step speculates its one chunk (the default chunk
    holds the whole model) and every clipped step rolls it back; the bits are still the
    non-overlapped runs'."""
    pytest.importorskip("stepcore.torch")
    rc, out = run_example(["--steps", "6", "--warmup", "2", "--quiet", "--speculation", "always"])
    assert rc == 0, out[-3000:]
    assert "bitwise: modes none, optimizer, full identical in params, exp_avg, exp_avg_sq, " \
        "step and norm after every step" in out, out
    assert "bitwise (overlap): modes none, optimizer, full identical after every step" in out, out
    assert "refused" not in out, out
    prefix = ("bitwise: overlapped runs (modes none, optimizer, full) identical to their "
              "non-overlapped runs in params, exp_avg, exp_avg_sq, step and norm after every "
              "step; chunks over 6 steps: ")
    line = next((x for x in out.splitlines() if x.startswith(prefix)), None)
    assert line is not None, out
    counts = line[len(prefix):].split("; ")
    assert len(counts) == len(lm.MODES), line
    for mode, c in zip(lm.MODES, counts):
        words = c.split()  # "<mode> N speculated, N committed, N rolled back"
        assert words[0] == mode, line
        speculated, committed, rolled_back = int(words[1]), int(words[3]), int(words[5])
        assert speculated == 6 and committed + rolled_back == speculated, line
        assert rolled_back > 0, line  # the first steps clip at max_norm 1.0
    assert "vs torch: max |loss diff|" in out, out


def test_the_example_on_two_fsdp2_processes_equals_one_process():
    """--processes 2: FSDP2 over gloo, every mode, the 1-process norms and bits."""
    pytest.importorskip("stepcore.torch")
    rc, out = run_example(["--steps", "4", "--warmup", "2", "--quiet", "--processes", "2",
                           "--formula", "native"])
    assert rc == 0, out[-3000:]
    assert "bitwise: 2 processes (FSDP2), modes none, optimizer, full identical" in out, out
    assert "vs 1 process: norms identical at every step; params, exp_avg, exp_avg_sq and " \
        "step identical after every step" in out, out


@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_the_8bit_example_trains_and_equals_torchao(tmp_path, model):
    """examples/train_tiny_lm_8bit.py, on the tiny LM and on a Hugging Face Llama: f32 AdamW
    and AdamW8bit both learn; stepcore's AdamW8bit gives torchao's AdamW8bit params after
    every step; 8-bit state is about a quarter of the f32 state's bytes; the curves are
    written."""
    pytest.importorskip("stepcore.torch")
    pytest.importorskip("torchao.optim")
    if model == "llama":
        pytest.importorskip("transformers", reason="tools/golden/setup_torch.sh installs it")
    svg = tmp_path / "loss.svg"
    rc, out = run_example(["--steps", "8", "--warmup", "2", "--csv", str(tmp_path / "loss.csv"),
                           "--svg", str(svg), "--model", model], script="train_tiny_lm_8bit.py")
    assert rc == 0, out[-3000:]
    assert "bitwise: stepcore AdamW8bit and torchao AdamW8bit params identical after every " \
        "step" in out, out
    first = [float(x) for x in out.split("step    0 ")[1].splitlines()[0].split()[1::2]]
    finals = {line.split(":")[0]: float(line.split("final loss ")[1].split(",")[0])
              for line in out.splitlines() if ": final loss " in line}
    assert set(finals) == {"f32", "8bit", "torchao"}, out
    for run, loss in finals.items():
        assert loss < first[0] - 0.5, (run, first, finals)
    state = {line.split(":")[0]: float(line.split("state ")[1].split()[0])
             for line in out.splitlines() if "bytes per param" in line}
    assert state["8bit"] < 0.3 * state["f32"], state
    rows = (tmp_path / "loss.csv").read_text().splitlines()
    assert rows[0] == "step,f32,8bit,torchao" and len(rows) == 9
    assert svg.read_text().count("<polyline") == 3

