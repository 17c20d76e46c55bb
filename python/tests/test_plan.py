"""stepcore.plan_memory: the planner from Python. Its figures equal what the managers report
(stepcore.torch.GradientManager over a torch module in every mode, after steps of two
micro-batches, overlapped, and a checkpoint save; _core.GradientManager over shapes), the
same as stepcore-plan prints; a Hugging Face config as a path or a dict gives the published
parameter counts; bad sizes raise TypeError / ValueError naming the argument."""

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

import stepcore
import stepcore._core as core

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "hf"
MODES = ("none", "optimizer", "full")


def test_shapes_plan_equals_a_managers_memory_in_every_mode():
    """_core.GradientManager over shapes (its own buffers) after steps of two micro-batches."""
    shapes = [(33, 3), 1, (0,), (1025,), [300, 2]]
    numels = [99, 1, 0, 1025, 600]
    for mode in MODES:
        for opt in ("adamw", "lion", "sign_sgd"):
            specs = [{"name": f"params[{i}]", "numel": n, "grad_dtype": "bf16",
                      "compute_dtype": "bf16"} for i, n in enumerate(numels)]
            m = core.GradientManager(mode, specs, optimizer=opt, device="host", threads=1)
            for _ in range(2):
                m.begin_step(1.0)
                for k in range(2):
                    m.begin_backward(k == 1)
                    for i in range(len(numels)):
                        m.gradient_ready(i)
                    m.finish_backward()
                m.step()
                m.report()
            got = m.memory()
            m.close()
            plan = stepcore.plan_memory(shapes, offload=mode, optimizer=opt, micro_batches=2)
            for key in ("kinds", "host_bytes", "host_peak", "device_bytes", "device_peak"):
                assert plan[key] == got[key], (mode, opt, key)
            assert plan["model_params"] == sum(numels)
            assert plan["fits_host"] is None and plan["fits_gpu"] is None


def step_twice(gm, model, tokens, overlap):
    """One step of two micro-batches through the manager (overlapped or not)."""
    gm.begin_step(1.0, overlap_optimizer=overlap)
    for k in range(2):
        gm.begin_backward(final_backward=k == 1)
        model(tokens).float().square().mean().backward()
        gm.finish_backward()
    gm.step()


def test_torch_module_plan_equals_the_torch_managers_report():
    """stepcore.torch.GradientManager over a bf16 module (the model's own gradients and
    weights): report()["memory"] equals plan_memory(module) after each phase."""
    torch = pytest.importorskip("torch")
    import stepcore.torch as st

    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 40),
                                torch.nn.LayerNorm(40), torch.nn.Linear(40, 50, bias=False))
    model = model.to(torch.bfloat16)
    tokens = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as d:
        for mode in MODES:
            gm = st.GradientManager(model, offload=mode, lr=1e-3, threads=1)
            for overlap in (False, True):
                step_twice(gm, model, tokens, overlap)
                plan = stepcore.plan_memory(model, offload=mode, micro_batches=2, overlap=overlap)
                got = gm.report()["memory"]
                assert {k: plan[k] for k in got} == got, (mode, overlap)
            if mode == "full":  # the dtype of the module, its parameters' names
                assert plan["kinds"]["gradient@device"]["bytes"] == 0
            path = os.path.join(d, f"{mode}.ckpt")
            gm._m.save_checkpoint(path)
            plan = stepcore.plan_memory(model, offload=mode, micro_batches=2, overlap=True,
                                        checkpoint="save")
            got = gm.report()["memory"]
            assert {k: plan[k] for k in got} == got, (mode, "save")
            gm.close()


def test_an_8bit_managers_report_equals_its_plan_in_every_mode():
    """GradientManager(optimizer="adamw8bit") over a bf16 module with tensors on both sides
    of min_8bit_size: report()["memory"] equals plan_memory(..., optimizer="adamw8bit"),
    whose 8-bit slots take a quarter of the f32 slots' bytes (plus the maxima)."""
    torch = pytest.importorskip("torch")
    import stepcore.torch as st

    model = torch.nn.Sequential(torch.nn.Embedding(300, 32), torch.nn.Linear(32, 300))
    model = model.to(torch.bfloat16)
    tokens = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(0))
    for mode in MODES:
        gm = st.GradientManager(model, offload=mode, optimizer="adamw8bit", lr=1e-3, threads=1,
                                min_8bit_size=1000)
        for overlap in (False, True):
            step_twice(gm, model, tokens, overlap)
            plan = stepcore.plan_memory(model, offload=mode, optimizer="adamw8bit",
                                        micro_batches=2, overlap=overlap, min_8bit_size=1000)
            got = gm.report()["memory"]
            assert {k: plan[k] for k in got} == got, (mode, overlap)
        gm.close()
    f32 = stepcore.plan_memory(model, offload="full", min_8bit_size=1000)["kinds"]
    q8 = stepcore.plan_memory(model, offload="full", optimizer="adamw8bit",
                              min_8bit_size=1000)["kinds"]
    assert q8["exp_avg"]["bytes"] < 0.4 * f32["exp_avg"]["bytes"], (q8, f32)
    with pytest.raises(ValueError, match="min_8bit_size"):
        stepcore.plan_memory(model, offload="full", optimizer="adamw8bit", min_8bit_size=-1)


def test_hugging_face_configs_by_path_and_dict_and_the_cli_agree():
    llama = stepcore.plan_memory(DATA / "llama3-70b.json", offload="full", ranks=8,
                                 ranks_per_node=8, host_memory=3840 * 10**9,
                                 gpu_memory=80 << 30, checkpoint="load")
    assert llama["model_params"] == 70553706496 and llama["tensors"] == 723
    assert llama["params_per_rank"] == 8819213312
    # 16 B/param (f32 master, two moments, accumulator) and three 4 MiB rings.
    assert llama["host_bytes"] == 16 * llama["params_per_rank"] + 3 * 4194304
    assert llama["fits_host"] is True and llama["fits_gpu"] is True
    assert llama["node_host_peak"] == 8 * llama["host_peak"]
    as_dict = stepcore.plan_memory(json.loads((DATA / "llama3-70b.json").read_text()),
                                   offload="full", ranks=8, ranks_per_node=8,
                                   host_memory=3840 * 10**9, gpu_memory=80 << 30,
                                   checkpoint="load")
    assert as_dict == llama
    qwen = stepcore.plan_memory(str(DATA / "qwen2.5-0.5b.json"), offload="none")
    assert qwen["model_params"] == 494032768
    exe = os.environ.get("STEPCORE_PLAN")
    if exe:  # the CLI prints the same bytes
        out = subprocess.run([exe, "--hf-config", str(DATA / "llama3-70b.json"), "--ranks", "8",
                              "--ranks-per-node", "8", "--host-memory", "3840GB"],
                             capture_output=True, text=True, check=True).stdout
        row = next(line.split() for line in out.splitlines() if line.startswith("host total"))
        assert int(row[3]) == llama["host_bytes"], out
        # 8-bit state by the same name, and the same threshold, in both.
        q8 = stepcore.plan_memory(DATA / "llama3-70b.json", offload="full", ranks=8,
                                  ranks_per_node=8, optimizer="adamw8bit", checkpoint="load",
                                  min_8bit_size=20_000_000)
        out = subprocess.run([exe, "--hf-config", str(DATA / "llama3-70b.json"), "--ranks", "8",
                              "--ranks-per-node", "8", "--optimizer", "adamw8bit",
                              "--min-8bit-size", "20000000"],
                             capture_output=True, text=True, check=True).stdout
        rows = {line[:20].strip(): line[20:].split() for line in out.splitlines()}
        assert int(rows["exp_avg"][1]) == q8["kinds"]["exp_avg"]["bytes"], out
        assert int(rows["host total"][1]) == q8["host_bytes"] < llama["host_bytes"], out


def test_bad_sizes_and_models_name_the_argument():
    def refused(exc, name, model=1000, **kw):
        kw.setdefault("offload", "full")
        with pytest.raises(exc, match=f"{name}'"):
            stepcore.plan_memory(model, **kw)

    refused(TypeError, "model", model=7e9)
    refused(TypeError, "model", model=True)
    refused(TypeError, "model", model=None)
    refused(ValueError, "model", model=-5)
    refused(ValueError, r"model\[1\]", model=[(3, 4), (5, -1)])
    refused(TypeError, r"model\[0\]", model=[(3, 4.0)])
    refused(TypeError, r"model\[0\]", model=["3x4"])
    refused(ValueError, "ranks", ranks=0)
    refused(TypeError, "ranks", ranks=2.0)
    refused(ValueError, "ranks_per_node", ranks=2, ranks_per_node=3)
    refused(ValueError, "micro_batches", micro_batches=0)
    refused(ValueError, "ring_slots", ring_slots=0)
    refused(ValueError, "ring_slots", ring_slots=10**6)
    refused(ValueError, "speculation_bytes", speculation_bytes=-3)
    refused(TypeError, "host_memory", host_memory=1.5e12)
    refused(ValueError, "optimizer", optimizer="muon")
    refused(ValueError, "offload_mode", offload="fsdp")
    refused(ValueError, "checkpoint", checkpoint="both")
    refused(TypeError, "dtype", dtype="int8")
    refused(ValueError, "sgd.nesterov", optimizer="sgd", hyper={"nesterov": 0.5})
    with tempfile.TemporaryDirectory() as d:
        broken = os.path.join(d, "config.json")
        Path(broken).write_text('{"vocab_size": 10, "hidden_size": ')
        refused(ValueError, "config.json", model=broken)
        refused(OSError, "missing.json", model=os.path.join(d, "missing.json"))
    refused(ValueError, "model", model={"vocab_size": 10})
    refused(TypeError, "model", model={"vocab_size": object()})
