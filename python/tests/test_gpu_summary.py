"""tools/gpu_summary.py, the device check's table of figures: every device cell reads
"n/a (no device)" without a GPU (the rehearsal), and with one the figures the programs
wrote, read back into the table and summary.json."""
import json
import os
import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "tools" / "gpu_summary.py"


def write(folder, name, obj):
    (folder / name).write_text(json.dumps(obj) if not isinstance(obj, str) else obj)


def run(folder, have_gpu):
    out = subprocess.run([sys.executable, str(SCRIPT), str(folder), "1" if have_gpu else "0"],
                         capture_output=True, text=True, check=True).stdout
    rows = dict(line.split("  ", 1) for line in out.splitlines()[1:])
    return {k.strip(): v.strip() for k, v in rows.items()}, json.loads(
        (folder / "summary.json").read_text())


def nccl_step(device):
    return {"device": device, "runs": [
        {"mode": m, "optimizer": o, "nccl": m != "full", "bitwise": True,
         "host_syncs": [k + 1, k + 1]}
        for k, m in enumerate(("none", "optimizer", "full")) for o in ("adamw", "sign_sgd")],
        "norm": {"stepcore": "0.1", "float_allreduce_ulps": -3, "double_reference_ulps": 0}}


def test_without_a_gpu_every_device_cell_says_so(tmp_path):
    write(tmp_path, "phases.tsv", "env\tpass\t0\tno GPU\nbuild\tpass\t49\t9 targets\n")
    write(tmp_path, "nccl-step-host.json", nccl_step("host+in-process"))
    write(tmp_path, "ctest-results.txt", "GpuSteps.A skipped\nGpuSteps.B skipped\n")
    # A stale device file from an earlier run is not read without a GPU.
    write(tmp_path, "bench-gpu.json", {"rows": [{"name": "adamw", "ratio": 0.9, "gbps": 1.0,
                                                 "host_us": 1.0, "ms": 1.0}]})
    rows, summary = run(tmp_path, False)
    assert rows["each optimizer: ratio to a device copy"] == "n/a (no device)"
    assert "adamw: ratio to a device copy" not in rows
    assert rows["host cost per call: scale+norm (2,000 small tensors)"] == "n/a (no device)"
    assert rows["host cost per call: AdamW (model list, repeated)"] == "n/a (no device)"
    assert rows["host syncs per manager step, mode full (counted)"] == (
        "n/a (no device); host device: adamw 3/3, sign_sgd 3/3")
    assert rows["CPU == GPU, suite GpuSteps"] == "n/a (no device) (2 tests)"
    assert rows["NCCL norm vs a float all-reduce (step 1)"] == "n/a (no device)"
    assert summary["have_gpu"] is False
    assert [p["phase"] for p in summary["phases"]] == ["env", "build"]
    assert summary["phases"][1]["seconds"] == 49


def test_with_a_gpu_the_figures_come_from_the_programs(tmp_path):
    rows_in = [{"name": n, "ms": 1.0, "gbps": g, "ratio": r, "host_us": h, "optimizer": o}
               for n, g, r, h, o in (("norm only (bf16, read)", 3900.0, 0.85, 20.0, False),
                                     ("scale+norm (bf16, scale 2^-12)", 4000.0, 0.9, 25.0, False),
                                     ("accumulate bf16 -> f32", 4100.0, 0.91, 30.0, False),
                                     ("adamw (f32 state, bf16 g/out)", 3800.0, 0.8, 60.0, True),
                                     ("sign_sgd (f32 state, bf16 g/out)", 3950.0, 0.88, 40.0, True),
                                     ("lion (f32 state, bf16 g/out)", 3700.0, 0.79, 50.0, True))]
    write(tmp_path, "bench-gpu.json", {"device": "H200", "tensors": 433, "probe_gbps": 4400.0,
                                       "rows": rows_in, "host_us_small_call": 12.5})
    write(tmp_path, "nccl-step.json", nccl_step("cuda+nccl"))
    write(tmp_path, "ctest-results.txt", "GpuSteps.A passed\nGpuSteps.B passed\n")
    rows, summary = run(tmp_path, True)
    assert rows["adamw: ratio to a device copy"] == "0.800 (3800 GB/s)"
    assert rows["lion: ratio to a device copy"] == "0.790 (3700 GB/s)"
    assert "each optimizer: ratio to a device copy" not in rows
    assert rows["norm: ratio to a device copy"] == "0.850 (3900 GB/s)"
    assert rows["host cost per call: AdamW (433 tensors, repeated)"] == "60.0 us"
    assert rows["host cost per call: scale+norm (2,000 small tensors)"] == "12.5 us"
    assert rows["host syncs per manager step, mode none (counted)"] == "adamw 1/1, sign_sgd 1/1"
    assert rows["CPU == GPU, suite GpuSteps"] == "bitwise: 2 passed"
    assert rows["CPU == GPU, manager steps (stepcore-gpu-nccl-step)"] == "bitwise: every run"
    assert rows["NCCL norm vs a float all-reduce (step 1)"].startswith("float all-reduce -3 ulp")
    assert len(summary["figures"]) == len(rows)


CHECK = SCRIPT.parent / "gpu-check.sh"


def test_the_headers_default_budget_is_the_codes():
    text = CHECK.read_text()
    header = re.search(r"STEPCORE_GPU_BUDGET +seconds the whole check may take \(default (\d+)\)",
                       text)
    code = re.search(r"^default_budget=(\d+)$", text, re.M)
    assert header and code and header.group(1) == code.group(1)
    assert "budget=${STEPCORE_GPU_BUDGET:-$default_budget}" in text


def executable(path, text):
    path.write_text(text)
    path.chmod(0o755)


def run_check(tmp_path, sanitizer_lines, sanitizer_rc):
    """gpu-check.sh's env and sanitizer phases only, on a stand-in GPU (nvidia-smi lists
    one) with stand-in kernel tests and a stand-in compute-sanitizer printing the given
    lines: returns the files in $OUT and the phases of its summary."""
    bin_dir, build, out = tmp_path / "bin", tmp_path / "build", tmp_path / "out"
    (build / "tests").mkdir(parents=True)
    bin_dir.mkdir()
    for t in ("test_gpu_kernels", "test_gpu_steps", "test_gpu_conversions", "test_cuda_device"):
        executable(build / "tests" / t, "#!/bin/sh\nexit 0\n")
    executable(bin_dir / "nvidia-smi", '#!/bin/sh\ncase "$*" in\n'
               '  -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-stand-in)" ;;\n'
               '  *) echo "NVIDIA H200" ;;\nesac\n')
    body = "".join(f"echo '{line}'\n" for line in sanitizer_lines)
    executable(bin_dir / "compute-sanitizer",
               '#!/bin/sh\n[ "$1" = --version ] && { echo "Version 0 (stand-in)"; exit 0; }\n'
               f"{body}exit {sanitizer_rc}\n")
    env = dict(os.environ, OUT=str(out), STEPCORE_GPU_BUILD=str(build),
               STEPCORE_GPU_PHASES="env sanitizer",
               STEPCORE_SANITIZER=str(bin_dir / "compute-sanitizer"),
               PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
    subprocess.run(["bash", str(CHECK)], env=env, capture_output=True, text=True, timeout=120)
    phases = {p["phase"]: p for p in json.loads((out / "summary.json").read_text())["phases"]}
    return sorted(p.name for p in out.iterdir()), phases


def test_the_check_returns_four_files_and_a_refusing_sanitizer_is_a_skip(tmp_path):
    files, phases = run_check(tmp_path, [
        "========= COMPUTE-SANITIZER", "========= Error: Device not supported",
        '========= Program hit cudaErrorUnknown (error 999) due to "unknown error" on CUDA '
        "API call to cudaMalloc.", "========= ERROR SUMMARY: 1 error"], 99)
    assert files == ["data.tar.gz", "gpu-check.log", "summary.json", "summary.txt"]
    assert phases["sanitizer"]["status"] == "skip", phases["sanitizer"]
    assert "refused the device" in phases["sanitizer"]["note"]
    # An error the sanitizer found on a device it supports is a failure, GPU or not.
    _, phases = run_check(tmp_path / "errors", [
        "========= Invalid __global__ read of size 4 bytes", "========= ERROR SUMMARY: 1 error"], 99)
    assert phases["sanitizer"]["status"] == "FAIL", phases["sanitizer"]
