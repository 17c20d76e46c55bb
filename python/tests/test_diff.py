"""Tests of stepcore.diff: the comparer on crafted pairs, corrupt inputs, the Recorder.

The crafted safetensors files are built here byte by byte (struct + json, not the
package's writer), with bit patterns whose ulp distances, class differences and medians
are worked out by hand in the comments; every comparison reads bits, never tolerances.
Every corrupt input runs `python -m stepcore.diff` in a subprocess and must exit 2 with a
message naming the file and the problem. The comparison is the C++ comparer's, through
stepcore._core: these tests check it independently (hand-computed ulps, signed zero, NaN
classes). If a C++ `stepcore-diff` is found (STEPCORE_DIFF, PATH, or
build/*/apps/stepcore-diff) its --json is checked against the binding's on the same
crafted cases. Then the Recorder (its journal, shards with their placement), and files
truncated while compared.
"""

import builtins
import glob
import json
import math
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import stepcore
import stepcore.diff as sd

# An extension built without nlohmann-json has no comparer (stepcore.diff.compare raises
# ImportError saying so): nothing here can run there.
pytestmark = pytest.mark.skipif(not hasattr(stepcore._core, "diff_compare"),
                                reason="stepcore._core was built without the comparer")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


# ---- crafting files by hand -----------------------------------------------------------


def f32_bits(*bits):
    """Raw little-endian bytes of f32 bit patterns."""
    return struct.pack(f"<{len(bits)}I", *bits)


def u16_bits(*bits):
    """Raw little-endian bytes of 16-bit patterns (BF16, F16)."""
    return struct.pack(f"<{len(bits)}H", *bits)


def craft(path, tensors, *, header=None, data=None):
    """Writes a safetensors file of [(name, dtype, shape, raw)]; header/data override (corrupt)."""
    h, off = {}, 0
    for name, dtype, shape, raw in tensors:
        h[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    text = json.dumps(h if header is None else header).encode()
    body = b"".join(raw for *_, raw in tensors) if data is None else data
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + body)
    return str(path)


def pair(tmp_path, a, b, name="t"):
    """Writes files A and B with one tensor list each; returns their paths."""
    return (craft(tmp_path / f"{name}-a.safetensors", a),
            craft(tmp_path / f"{name}-b.safetensors", b))


def one(result, name="x"):
    """The result's entry for tensor `name`."""
    (t,) = [t for t in result["tensors"] if t["name"] == name]
    return t


def run_cli(*args):
    """Runs python -m stepcore.diff; returns (exit status, stdout, stderr)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    p = subprocess.run([sys.executable, "-m", "stepcore.diff", *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout, p.stderr


# ---- crafted pairs ----------------------------------------------------------------------

ONE, TWO, TWO_UP = 0x3F800000, 0x40000000, 0x40000001  # 1.0, 2.0, nextafter(2, inf)


def crafted_cases(tmp_path):
    """The crafted pairs: name -> (A, B, max_ulps); shared with the C++ cross-check."""
    c = {}
    c["identical"] = (*pair(tmp_path, [("x", "F32", [3], f32_bits(ONE, TWO, 0xC0400000))],
                            [("x", "F32", [3], f32_bits(ONE, TWO, 0xC0400000))], "identical"), 0)
    c["one_ulp"] = (*pair(tmp_path, [("x", "F32", [3], f32_bits(ONE, TWO, ONE))],
                          [("x", "F32", [3], f32_bits(ONE, TWO_UP, ONE))], "one_ulp"), 0)
    c["one_ulp_tolerated"] = (*c["one_ulp"][:2], 1)
    c["nan_payload"] = (*pair(tmp_path, [("x", "F32", [2], f32_bits(0x7FC00000, ONE))],
                              [("x", "F32", [2], f32_bits(0x7FC00001, ONE))], "nan"), 0)
    c["signed_zero"] = (*pair(tmp_path, [("x", "F32", [2], f32_bits(0x80000000, ONE))],
                              [("x", "F32", [2], f32_bits(0x00000000, ONE))], "zero"), 0)
    c["inf_vs_max"] = (*pair(tmp_path, [("x", "F32", [1], f32_bits(0x7F800000))],
                             [("x", "F32", [1], f32_bits(0x7F7FFFFF))], "inf"), 0)
    c["inf_vs_max_tolerance"] = (*c["inf_vs_max"][:2], 10)
    c["missing"] = (*pair(tmp_path,
                          [("x", "F32", [1], f32_bits(ONE)), ("y", "F32", [1], f32_bits(ONE))],
                          [("x", "F32", [1], f32_bits(ONE)), ("z", "F32", [1], f32_bits(ONE))],
                          "missing"), 0)
    c["mismatch"] = (*pair(tmp_path,
                           [("s", "F32", [2, 3], f32_bits(*[ONE] * 6)),
                            ("d", "F32", [2], f32_bits(ONE, ONE))],
                           [("s", "F32", [6], f32_bits(*[ONE] * 6)),
                            ("d", "I32", [2], f32_bits(ONE, ONE))], "mismatch"), 0)
    c["bf16"] = (*pair(tmp_path, [("x", "BF16", [2], u16_bits(0x3F80, 0x8001))],
                       [("x", "BF16", [2], u16_bits(0x3F82, 0x0001))], "bf16"), 0)
    c["f16"] = (*pair(tmp_path, [("x", "F16", [2], u16_bits(0x3C00, 0x7BFF))],
                      [("x", "F16", [2], u16_bits(0x3BFF, 0x7C00))], "f16"), 0)
    # distances of the differing non-NaN pairs: 1, 1, 2, 5, 7, 100 (k = 6): lower median 2
    # (the upper median would be 5, the mean 19.33); the NaN-vs-number pair has none.
    base = [ONE, ONE, ONE, 0xBF800000, ONE, ONE, ONE, ONE, ONE]
    other = [ONE + 1, ONE, ONE + 100, 0xBF800002, ONE + 7, ONE + 1, ONE, 0x7FC00000, ONE + 5]
    c["median"] = (*pair(tmp_path, [("x", "F32", [9], f32_bits(*base))],
                         [("x", "F32", [9], f32_bits(*other))], "median"), 0)
    c["two_ulps_over"] = (*pair(tmp_path, [("x", "F32", [1], f32_bits(TWO))],
                                [("x", "F32", [1], f32_bits(TWO + 2))], "over"), 1)
    c["bitwise_int"] = (*pair(tmp_path, [("x", "I64", [2], struct.pack("<2q", 5, -1))],
                              [("x", "I64", [2], struct.pack("<2q", 5, -2))], "int"), 3)
    c["recording"] = (*three_step_recordings(tmp_path), 0)
    return c


def three_step_recordings(tmp_path):
    """Two 3-step recordings whose first divergence is step 2's zeta (recorded before alpha)."""
    # Step 1 identical; at step 2 zeta and alpha differ by 1 ulp and B records its step 2
    # in another order; at step 3 zeta differs more.
    out = []
    for side in "ab":
        rec = sd.Recorder(tmp_path / f"rec-{side}", {"side": side})
        w = np.array([1.0, 2.0, 3.0], np.float32)
        rec.record("grad", "w", w)
        rec.record("after_step", "w", w)
        rec.next_step()
        d = np.float32(0.5) if side == "a" else np.nextafter(np.float32(0.5), np.float32(1))
        zeta = np.array([d, 1.0], np.float32)
        alpha = np.array([4.0, d], np.float32)
        order = [("grad", "w", w), ("after_step", "zeta", zeta), ("after_step", "alpha", alpha)]
        if side == "b":
            order = order[::-1]
        for point, name, t in order:
            rec.record(point, name, t)
        rec.next_step()
        rec.record("after_step", "zeta", zeta + np.float32(side == "b"))
        rec.close()
        out.append(str(tmp_path / f"rec-{side}"))
    return out


@pytest.fixture
def cases(tmp_path):
    """The crafted cases in a fresh directory."""
    return crafted_cases(tmp_path)


def test_identical_files(cases):
    """Same bits: status identical, exit 0, nothing differing."""
    r = sd.compare(*cases["identical"][:2])
    assert r["identical"] is True and r["exit_status"] == 0 and r["first_divergence"] is None
    t = one(r)
    assert (t["status"], t["differing"], t["fraction"], t["max_ulps"], t["first_index"]) == \
        ("identical", 0, 0.0, 0, None)
    assert r["summary"] == {"tensors": 1, "identical": 1, "different": 0,
                            "within_tolerance": 0, "missing_in_a": 0, "missing_in_b": 0,
                            "shape_mismatch": 0, "dtype_mismatch": 0}
    assert (t["step"], t["rank"], t["point"]) == (None, None, None)


def test_one_f32_ulp(cases):
    """2.0 vs its upper neighbour at index 1: 1 ulp, first_index 1, both bit patterns."""
    r = sd.compare(*cases["one_ulp"][:2])
    t = one(r)
    assert t["status"] == "different" and r["exit_status"] == 1
    assert (t["differing"], t["elements"], t["max_ulps"], t["median_ulps"]) == (1, 3, 1, 1)
    assert t["fraction"] == 1 / 3
    assert (t["first_index"], t["a_hex"], t["b_hex"]) == (1, "0x40000000", "0x40000001")
    assert (t["a_value"], t["b_value"]) == (2.0, 2.0 + 2.0**-22)  # JSON numbers, exact
    assert (t["nan_vs_number"], t["nan_payload"], t["signed_zero"], t["inf"]) == (0, 0, 0, 0)
    assert r["first_divergence"] == {"step": None, "point": None, "name": "x", "rank": None}


def test_nan_payloads(cases):
    """0x7fc00000 vs 0x7fc00001: one differing element, a NaN payload, no ulp distance."""
    t = one(sd.compare(*cases["nan_payload"][:2]))
    assert (t["status"], t["differing"], t["nan_payload"], t["nan_vs_number"]) == \
        ("different", 1, 1, 0)
    assert (t["max_ulps"], t["median_ulps"], t["first_index"]) == (0, 0, 0)
    assert (t["a_hex"], t["b_hex"], t["a_value"]) == ("0x7fc00000", "0x7fc00001", "nan")
    # a NaN difference is never tolerated
    assert one(sd.compare(*cases["nan_payload"][:2], max_ulps=1000))["status"] == "different"


def test_signed_zero(cases):
    """-0 vs +0: bits differ (status different), signed_zero 1, distance 0 across zero."""
    t = one(sd.compare(*cases["signed_zero"][:2]))
    assert (t["status"], t["differing"], t["signed_zero"], t["max_ulps"], t["median_ulps"]) \
        == ("different", 1, 1, 0, 0)
    assert (t["a_hex"], t["b_hex"], t["a_value"], t["b_value"]) == \
        ("0x80000000", "0x00000000", 0.0, 0.0)
    assert math.copysign(1.0, t["a_value"]) == -1.0 and math.copysign(1.0, t["b_value"]) == 1.0
    # 0 ulps apart, but a class difference: never within tolerance (docs/diff.md)
    assert one(sd.compare(*cases["signed_zero"][:2], max_ulps=1))["status"] == "different"


def test_inf_vs_flt_max(cases):
    """+Inf vs FLT_MAX: adjacent in the ordering (1 ulp), counted as inf, never tolerated."""
    t = one(sd.compare(*cases["inf_vs_max"][:2]))
    assert (t["status"], t["max_ulps"], t["inf"], t["nan_vs_number"]) == ("different", 1, 1, 0)
    assert (t["a_value"], t["b_value"]) == ("inf", (2.0 - 2.0**-23) * 2.0**127)
    assert one(sd.compare(*cases["inf_vs_max_tolerance"][:2], max_ulps=10))["status"] == "different"


def test_missing_both_directions(cases):
    """y only in A (missing_in_b), z only in B (missing_in_a, after A's tensors); first: y."""
    r = sd.compare(*cases["missing"][:2])
    assert [(t["name"], t["status"]) for t in r["tensors"]] == \
        [("x", "identical"), ("y", "missing_in_b"), ("z", "missing_in_a")]
    assert r["first_divergence"]["name"] == "y" and r["exit_status"] == 1
    assert (r["summary"]["missing_in_a"], r["summary"]["missing_in_b"]) == (1, 1)
    z = one(r, "z")
    assert (z["dtype"], z["shape"], z["elements"], z["differing"]) == ("F32", [1], 1, None)
    # swapped inputs swap the statuses
    r2 = sd.compare(*cases["missing"][1::-1])
    assert [(t["name"], t["status"]) for t in r2["tensors"]] == \
        [("x", "identical"), ("z", "missing_in_b"), ("y", "missing_in_a")]


def test_shape_and_dtype_mismatch(cases):
    """Same bytes, other shape: shape_mismatch; same bytes, other dtype: dtype_mismatch."""
    r = sd.compare(*cases["mismatch"][:2])
    assert one(r, "s")["status"] == "shape_mismatch"
    assert one(r, "d")["status"] == "dtype_mismatch"
    assert r["summary"]["shape_mismatch"] + r["summary"]["dtype_mismatch"] == 2
    assert r["exit_status"] == 1
    assert one(r, "s")["differing"] is None
    rc, out, _ = run_cli(*cases["mismatch"][:2])
    assert rc == 1
    # stepcore-diff's table: A's dtype and shape / B's
    assert [line.split()[:4] for line in out.splitlines()[1:3]] == \
        [["s", "shape_mismatch", "F32", "[2,3]/[6]"], ["d", "dtype_mismatch", "F32/I32", "[2]/[2]"]], out
    assert out.splitlines()[-1] == "2 tensors: 1 shape mismatch, 1 dtype mismatch", out


def test_bf16_distances(cases):
    """BF16 0x3f80 vs 0x3f82: 2 ulps; 0x8001 vs 0x0001: 1 + 1 = 2 across zero."""
    t = one(sd.compare(*cases["bf16"][:2]))
    assert (t["differing"], t["max_ulps"], t["median_ulps"]) == (2, 2, 2)
    assert (t["a_hex"], t["b_hex"], t["a_value"]) == ("0x3f80", "0x3f82", 1.0)


def test_f16_distances(cases):
    """F16 0x3c00 vs 0x3bff: 1 ulp; 0x7bff (65504) vs 0x7c00 (+Inf): 1 ulp, inf 1."""
    t = one(sd.compare(*cases["f16"][:2]))
    assert (t["differing"], t["max_ulps"], t["median_ulps"], t["inf"]) == (2, 1, 1, 1)
    assert (t["a_hex"], t["b_hex"], t["a_value"], t["b_value"]) == \
        ("0x3c00", "0x3bff", 1.0, 1.0 - 2.0**-11)


def test_lower_median_of_a_crafted_distribution(cases):
    """Distances 1, 1, 2, 5, 7, 100 (k = 6, the NaN pair excluded): median 2, max 100."""
    t = one(sd.compare(*cases["median"][:2]))
    assert (t["differing"], t["max_ulps"], t["median_ulps"], t["nan_vs_number"]) == \
        (7, 100, 2, 1)
    assert t["first_index"] == 0


def test_max_ulps_acceptance(cases):
    """--max-ulps 1 accepts the 1-ulp pair (exit 0, not 'identical'), not a 2-ulp one."""
    r = sd.compare(*cases["one_ulp"][:2], max_ulps=1)
    assert (one(r)["status"], r["exit_status"], r["identical"], r["first_divergence"]) == \
        ("within_tolerance", 0, False, None)
    assert r["summary"]["within_tolerance"] == 1
    rc, out, _ = run_cli(*cases["one_ulp"][:2], "--max-ulps", "1")
    # accepted by the tolerance, never called identical
    assert rc == 0 and out.splitlines()[-1] == \
        "within tolerance: 1 tensor (0 identical, 1 within 1 ulps)", out
    assert "identical:" not in out and "within_tolerance" in out.splitlines()[1], out
    rc, _, _ = run_cli(*cases["one_ulp"][:2], "--max-ulps", "0")
    assert rc == 1
    r = sd.compare(*cases["two_ulps_over"][:2], max_ulps=1)
    assert (one(r)["status"], one(r)["max_ulps"], r["exit_status"]) == ("different", 2, 1)


def test_bitwise_only_dtypes_have_no_ulps(cases):
    """I64 is compared bit for bit: no ulp figures, no tolerance."""
    t = one(sd.compare(*cases["bitwise_int"][:2], max_ulps=3))
    assert (t["status"], t["differing"], t["max_ulps"], t["median_ulps"]) == \
        ("different", 1, None, None)
    assert (t["first_index"], t["a_hex"], t["b_hex"], t["a_value"], t["b_value"]) == \
        (1, "0xffffffffffffffff", "0xfffffffffffffffe", -1, -2)


def test_first_divergence_in_a_three_step_recording(cases):
    """Step 1 identical; step 2: zeta recorded before alpha in A, so zeta is first."""
    a, b, _ = cases["recording"]
    r = sd.compare(a, b)
    assert r["first_divergence"] == {"step": 2, "point": "after_step", "name": "zeta", "rank": 0}
    statuses = [(t["step"], t["point"], t["name"], t["status"]) for t in r["tensors"]]
    assert statuses == [(1, "grad", "w", "identical"), (1, "after_step", "w", "identical"),
                        (2, "grad", "w", "identical"), (2, "after_step", "zeta", "different"),
                        (2, "after_step", "alpha", "different"),
                        (3, "after_step", "zeta", "different")]
    z = r["tensors"][3]
    assert (z["key"], z["max_ulps"], z["first_index"]) == ("after_step/zeta", 1, 0)
    rc, out, _ = run_cli(a, b)
    assert rc == 1
    assert out.strip().splitlines()[-2:] == \
        ["first divergence: step 2, point after_step, name zeta, rank 0",
         "6 tensors: 3 identical, 3 different"], out
    assert "run metadata side: A 'a', B 'b'" in out
    rc, out, _ = run_cli(a, a)
    assert rc == 0 and out.strip().splitlines()[-1] == "identical: 6 tensors", out


def test_json_output_has_exactly_the_schema(cases):
    """--json: the top-level, tensor and summary keys of the shared schema, nothing else."""
    rc, out, _ = run_cli(*cases["median"][:2], "--json")
    assert rc == 1
    r = json.loads(out)
    assert set(r) == {"identical", "exit_status", "first_divergence", "tensors", "summary"}
    assert set(r["tensors"][0]) == {
        "step", "rank", "point", "name", "key", "status", "dtype", "shape", "elements",
        "differing", "fraction", "max_ulps", "median_ulps", "first_index", "a_hex", "b_hex",
        "a_value", "b_value", "nan_vs_number", "nan_payload", "signed_zero", "inf"}
    assert set(r["summary"]) == {"tensors", "identical", "different", "within_tolerance",
                                 "missing_in_a", "missing_in_b", "shape_mismatch",
                                 "dtype_mismatch"}
    assert r == sd.compare(*cases["median"][:2])


def test_files_are_walked_in_data_offset_order(tmp_path):
    """The header lists 'a' first but its data lies after 'b': b is the first divergence."""
    raw = f32_bits(ONE, TWO)
    header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    fa = craft(tmp_path / "a.safetensors", [], header=header, data=raw)
    fb = craft(tmp_path / "b.safetensors", [], header=header, data=f32_bits(ONE + 1, TWO + 1))
    r = sd.compare(fa, fb)
    assert [t["name"] for t in r["tensors"]] == ["b", "a"]
    assert r["first_divergence"]["name"] == "b"


def test_html_report_is_self_contained(cases, tmp_path):
    """--report: one HTML file with inline SVG (map cells, a histogram), nothing fetched."""
    a, b, _ = cases["recording"]
    out = tmp_path / "report.html"
    rc, _, _ = run_cli(a, b, "--report", out)
    assert rc == 1
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<svg" in text
    assert "<script" not in text and "src=" not in text and "href=" not in text
    assert "@import" not in text and "url(" not in text
    by_point, by_tensor = text.split("<h2>Step x tensor</h2>")
    # 3 steps x 2 points: 5 cells (step 3 has no 'grad'); the first divergence outlined
    assert by_point.count('class="cell"') == 5
    assert by_point.count('stroke="#000"') == 1
    assert "step 2, point after_step: different; 2 of 2 tensors" in by_point
    # one cell per recorded tensor (6), zeta's at step 2 outlined
    assert by_tensor.count('class="cell"') == 6
    assert by_tensor.count('stroke="#000"') == 1
    assert "step 2, tensor after_step/zeta: different; 1 of 1 tensors" in by_tensor
    assert "step 1, tensor grad/w: identical" in by_tensor
    # histograms of the 3 differing tensors; at step 2 each has one element 1 ulp apart
    assert text.count("<h3>") == 3
    assert text.count("<title>1 ulps: 1 elements</title>") == 2


# ---- corrupt inputs ---------------------------------------------------------------------


def good_file(tmp_path):
    """A valid one-tensor file to compare a corrupt one with."""
    return craft(tmp_path / "good.safetensors", [("x", "F32", [2], f32_bits(ONE, TWO))])


def entry(dtype="F32", shape=(2,), offs=(0, 8)):
    """A header entry."""
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offs)}


def _raw_file(tmp_path, content):
    """Writes raw bytes as bad.safetensors."""
    p = tmp_path / "bad.safetensors"
    p.write_bytes(content)
    return str(p)


CORRUPT_FILES = {
    "shorter than 8 bytes": (lambda t: _raw_file(t, b"\x01\x02\x03"),
                             "shorter than the 8-byte header length"),
    "header length past the end": (lambda t: _raw_file(t, struct.pack("<Q", 1000) + b"{}"),
                                   "header length 1000 runs past the end"),
    "header not JSON": (lambda t: _raw_file(t, struct.pack("<Q", 5) + b"{nope"),
                        "not valid JSON"),
    "header not UTF-8": (lambda t: _raw_file(t, struct.pack("<Q", 2) + b"\xff\xfe"),
                         "the header is not valid JSON"),
    "header a list": (lambda t: craft(t / "bad.safetensors", [], header=[1, 2], data=b""),
                      "the header is an array, not a JSON object"),
    "entry without dtype": (lambda t: craft(t / "bad.safetensors", [], header={
        "x": {"shape": [2], "data_offsets": [0, 8]}}, data=b"\0" * 8), "tensor 'x': no \"dtype\""),
    "entry without shape": (lambda t: craft(t / "bad.safetensors", [], header={
        "x": {"dtype": "F32", "data_offsets": [0, 8]}}, data=b"\0" * 8), "tensor 'x': no \"shape\""),
    "entry without offsets": (lambda t: craft(t / "bad.safetensors", [], header={
        "x": {"dtype": "F32", "shape": [2]}}, data=b"\0" * 8), "tensor 'x': no \"data_offsets\""),
    "entry not an object": (lambda t: craft(t / "bad.safetensors", [], header={"x": 3},
                                            data=b""), "its entry is an integer, not an object"),
    "offsets out of range": (lambda t: craft(t / "bad.safetensors", [], header={
        "x": entry(offs=(0, 8))}, data=b"\0" * 4), "run past the end of the data"),
    "begin > end": (lambda t: craft(t / "bad.safetensors", [], header={
        "x": entry(offs=(8, 0))}, data=b"\0" * 8), "data_offsets [8, 0]: begin > end"),
    "overlapping": (lambda t: craft(t / "bad.safetensors", [], header={
        "x": entry(offs=(0, 8)), "y": entry(offs=(4, 12))}, data=b"\0" * 12),
        "tensors 'x' [0, 8) and 'y' [4, 12) overlap"),
    "size not numel*itemsize": (lambda t: craft(t / "bad.safetensors", [], header={
        "x": entry(shape=(3,), offs=(0, 8))}, data=b"\0" * 8), "needs 12"),
    "negative shape": (lambda t: craft(t / "bad.safetensors", [], header={
        "x": entry(shape=(-2,))}, data=b"\0" * 8), "shape[0] is -2, negative"),
    "shape not a list": (lambda t: craft(t / "bad.safetensors", [], header={
        "x": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, data=b"\0" * 8),
        "\"shape\" is a string, not an array"),
    "unknown dtype": (lambda t: craft(t / "bad.safetensors", [], header={
        "x": entry(dtype="F8_E4M3", offs=(0, 2))}, data=b"\0" * 2), "unknown dtype \"F8_E4M3\""),
    "duplicate tensor": (lambda t: _raw_file(t, (lambda h: struct.pack("<Q", len(h)) + h)(
        b'{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        b'"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}') + b"\0" * 4),
        "the header has the key \"x\" twice in one object"),
    "bad metadata": (lambda t: craft(t / "bad.safetensors", [], header={
        "__metadata__": {"step": 1}}, data=b""), "\"__metadata__\" entry 'step' is an integer, not a string"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_FILES))
def test_corrupt_file_exits_2_naming_file_and_problem(tmp_path, case):
    """Each corrupt safetensors file: exit 2, the message names the file and the problem."""
    make, problem = CORRUPT_FILES[case]
    bad = make(tmp_path)
    for args in ((bad, good_file(tmp_path)), (good_file(tmp_path), bad)):
        rc, out, err = run_cli(*args)
        assert rc == 2, (case, out, err)
        assert bad in err and problem in err, (case, err)
        assert out == ""


def make_recording(tmp_path, name="good"):
    """A valid 2-step recording made by the Recorder."""
    rec = sd.Recorder(tmp_path / name)
    rec.record("p", "w", np.array([1.0, 2.0], np.float32))
    rec.next_step()
    rec.record("p", "w", np.array([3.0, 4.0], np.float32))
    rec.close()
    return str(tmp_path / name)


def edit_manifest(d, change):
    """Rewrites d/manifest.json with change(manifest) applied."""
    p = os.path.join(d, "manifest.json")
    with open(p) as f:
        m = json.load(f)
    change(m)
    with open(p, "w") as f:
        json.dump(m, f)


def edit_journal(d, change):
    """Rewrites d/entries.jsonl with change(list of entries) applied."""
    p = os.path.join(d, "entries.jsonl")
    with open(p) as f:
        lines = [json.loads(line) for line in f]
    change(lines)
    with open(p, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in lines)


def _set(key, value):
    """Returns a manifest change setting m[key] = value."""
    return lambda m: m.__setitem__(key, value)


def _entry(field, value):
    """Returns a journal change setting the first entry's field to value."""
    return lambda lines: lines[0].__setitem__(field, value)


# (change, the file named, the problem): the messages are the C++ comparer's.
CORRUPT_RECORDINGS = {
    "no manifest": (lambda d: os.remove(os.path.join(d, "manifest.json")),
                    "", "not a recording: no manifest.json"),
    "manifest not JSON": (lambda d: open(os.path.join(d, "manifest.json"), "w").write("{x"),
                          "manifest.json", "the manifest is not valid JSON"),
    "wrong format": (lambda d: edit_manifest(d, _set("format", "other")), "manifest.json",
                     '"format" is "other", not "stepcore-recording"'),
    "wrong version": (lambda d: edit_manifest(d, _set("version", 3)), "manifest.json",
                      '"version" is 3; this stepcore-diff reads versions 1 to 2'),
    "journal missing": (lambda d: edit_manifest(d, lambda m: m.pop("journal")),
                        "manifest.json", 'no "journal"'),
    "journal file missing": (lambda d: os.remove(os.path.join(d, "entries.jsonl")),
                             "manifest.json", "entries.jsonl does not exist"),
    "journal line not JSON": (lambda d: open(os.path.join(d, "entries.jsonl"), "a").write(
        "{x\n"), "entries.jsonl", "line 3 of the journal is not valid JSON"),
    "entry without key": (lambda d: edit_journal(d, lambda lines: lines[0].pop("key")),
                          "entries.jsonl", 'line 1 (step 1, rank 0, point p, name w): no "key"'),
    "bad step": (lambda d: edit_journal(d, _entry("step", -1)), "entries.jsonl",
                 'line 1: "step" is -1, not a non-negative integer'),
    "missing file": (lambda d: os.remove(os.path.join(d, "step000002-rank0.safetensors")),
                     "entries.jsonl", "step000002-rank0.safetensors does not exist"),
    "missing key": (lambda d: edit_journal(d, _entry("key", "p/nothing")),
                    "entries.jsonl", "key 'p/nothing' is not in"),
    "duplicate entries": (lambda d: edit_journal(
        d, lambda lines: lines.append(dict(lines[0]))), "entries.jsonl",
        "line 3 (step 1, rank 0, point p, name w): repeats the (step, rank, point, name) of "
        "line 1"),
    "manifest disagrees with file": (lambda d: edit_journal(d, _entry("shape", [1, 2])),
                                     "entries.jsonl",
                                     "the manifest says dtype F32, shape [1, 2], but"),
    "corrupt step file": (lambda d: open(os.path.join(d, "step000001-rank0.safetensors"),
                                         "wb").write(b"xx"),
                          "step000001-rank0.safetensors", "shorter than the 8-byte"),
    "file outside": (lambda d: edit_journal(d, _entry("file", "../x.safetensors")),
                     "entries.jsonl", "is not a relative path inside the recording"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_RECORDINGS))
def test_corrupt_recording_exits_2_naming_file_and_problem(tmp_path, case):
    """Each corrupt recording: exit 2, the message names the file and the problem."""
    change, file_part, problem = CORRUPT_RECORDINGS[case]
    good, bad = make_recording(tmp_path, "good"), make_recording(tmp_path, "bad")
    change(bad)
    rc, out, err = run_cli(good, bad)
    assert rc == 2, (case, out, err)
    named = os.path.join(bad, file_part) if file_part else bad
    assert named in err and problem in err, (case, err)
    with pytest.raises(sd.FormatError, match="bad"):
        sd.compare(good, bad)


def test_bad_arguments_exit_2(tmp_path):
    """A directory against a file, a path that does not exist, a bad --max-ulps, one input."""
    good, rec = good_file(tmp_path), make_recording(tmp_path)
    rc, _, err = run_cli(good, rec)
    assert rc == 2 and "A and B must both be recordings or both safetensors files" in err
    rc, _, err = run_cli(good, tmp_path / "nothing.safetensors")
    assert rc == 2 and f"{tmp_path / 'nothing.safetensors'}: cannot read: No such file" in err
    rc, _, err = run_cli(good, good, "--max-ulps", "-1")
    assert rc == 2 and "--max-ulps" in err
    rc, _, err = run_cli(good)
    assert rc == 2
    with pytest.raises(ValueError, match="'max_ulps'"):
        sd.compare(good, good, max_ulps=-1)
    rc, _, err = run_cli(good, good, "--report", tmp_path / "no" / "dir" / "r.html")
    assert rc == 2 and "the report" in err and "r.html" in err


# ---- the Recorder -----------------------------------------------------------------------


def parse_by_hand(path):
    """Reads a safetensors file with struct + json: (header dict, data bytes)."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def test_recorder_round_trip_is_bit_identical(tmp_path):
    """numpy and torch tensors of every kind come back with their exact bytes and fields."""
    # f32 with a NaN payload and -0, i64, bool, a numpy scalar, bf16, f16, 0-dim, a
    # transposed view; the manifest's fields, the run metadata, the files' metadata.
    torch = pytest.importorskip("torch")
    f32 = np.array([1.5, -0.0, np.inf], np.float32)
    f32 = np.concatenate([f32, np.array([0x7FC00123], np.uint32).view(np.float32)])
    bf = torch.tensor([1.0, -2.5, 3e38], dtype=torch.bfloat16)
    tensors = [("np_f32", f32.reshape(2, 2), "F32", [2, 2], f32.tobytes()),
               ("np_i64", np.array([[-1, 7]], np.int64), "I64", [1, 2],
                struct.pack("<2q", -1, 7)),
               ("np_bool", np.array([True, False, True]), "BOOL", [3], b"\x01\x00\x01"),
               ("np_scalar", np.float64(0.1), "F64", [], struct.pack("<d", 0.1)),
               ("t_bf16", bf, "BF16", [3], u16_bits(0x3F80, 0xC020, 0x7F62)),
               ("t_f16", torch.tensor([1.0, 65504.0], dtype=torch.float16), "F16", [2],
                u16_bits(0x3C00, 0x7BFF)),
               ("t_0dim", torch.tensor(2.0), "F32", [], f32_bits(TWO)),
               ("t_view", torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "F32",
                [3, 2], struct.pack("<6f", 0, 3, 1, 4, 2, 5))]
    rec = sd.Recorder(tmp_path / "r", {"purpose": "round trip"})
    for name, t, *_ in tensors:
        rec.record("pt", name, t)
    rec.next_step()
    rec.record("pt", "np_f32", f32)
    rec.close()
    assert int(bf.view(torch.int16)[2]) == 0x7F62  # 3e38 in bf16, as the bytes above say
    header, data = parse_by_hand(tmp_path / "r" / "step000001-rank0.safetensors")
    assert header["__metadata__"] == {"step": "1", "rank": "0"}
    offset = 0
    for name, _, dtype, shape, raw in tensors:
        e = header[f"pt/{name}"]
        assert (e["dtype"], e["shape"]) == (dtype, shape), name
        assert e["data_offsets"] == [offset, offset + len(raw)], name  # in order, no gaps
        b0, b1 = e["data_offsets"]
        assert data[b0:b1] == raw, name
        offset += len(raw)
    with open(tmp_path / "r" / "manifest.json") as f:
        m = json.load(f)
    assert (m["format"], m["version"], m["journal"]) == ("stepcore-recording", 2,
                                                         "entries.jsonl")
    with open(tmp_path / "r" / "entries.jsonl") as f:
        m["entries"] = [json.loads(line) for line in f]
    assert m["entries"][0] == {"step": 1, "point": "pt", "name": "np_f32", "rank": 0,
                               "file": "step000001-rank0.safetensors", "key": "pt/np_f32",
                               "dtype": "F32", "shape": [2, 2]}
    assert [(e["step"], e["name"]) for e in m["entries"]] == \
        [(1, t[0]) for t in tensors] + [(2, "np_f32")]
    import stepcore
    run = m["run"]
    assert {"stepcore_version", "isa", "threads", "device", "offload", "formula",
            "torch_version", "purpose"} <= set(run)
    assert (run["stepcore_version"], run["torch_version"], run["purpose"]) == \
        (stepcore.__version__, torch.__version__, "round trip")
    assert run["isa"] in stepcore.supported_isas()
    # the package's reader agrees with the hand parse
    r = sd.read_recording(tmp_path / "r")
    got = r.get(1, "pt", "np_f32")
    assert got.dtype == np.float32 and got.tobytes() == f32.tobytes()
    assert r.get(2, "pt", "np_f32").shape == (4,)
    assert r.get(1, "pt", "t_bf16").tolist() == [0x3F80, 0xC020, 0x7F62]


def test_format_matches_the_safetensors_package(tmp_path):
    """If the safetensors package is installed: it reads our files, we read its files."""
    st_numpy = pytest.importorskip("safetensors.numpy",
                                   reason="the safetensors package is not installed")
    import safetensors
    path = tmp_path / "w.safetensors"
    sd.write_file(path, [("a", "F32", [2], f32_bits(ONE, TWO)),
                         ("b", "I64", [1], struct.pack("<q", -3)),
                         ("c", "F16", [1, 1], u16_bits(0x3BFF))], {"k": "v"})
    got = st_numpy.load_file(str(path))
    assert got["a"].tobytes() == f32_bits(ONE, TWO) and got["b"].tolist() == [-3]
    assert got["c"].dtype == np.float16 and got["c"].shape == (1, 1)
    assert got["c"].view(np.uint16).tolist() == [[0x3BFF]]
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
    theirs = {"x": np.array([[1.5, -0.0]], np.float32), "n": np.array([7, 8], np.int16),
              "e": np.zeros((0, 3), np.float32)}
    st_numpy.save_file(theirs, str(tmp_path / "t.safetensors"), metadata={"m": "1"})
    f = sd.read_file(tmp_path / "t.safetensors")
    assert f.metadata == {"m": "1"}
    for name, want in theirs.items():
        assert f.array(name).dtype == want.dtype and f.array(name).shape == want.shape
        assert f.array(name).tobytes() == want.tobytes(), name
    assert sd.compare(tmp_path / "t.safetensors", tmp_path / "t.safetensors")["identical"]


def test_recorder_refuses_duplicates_and_bad_input(tmp_path):
    """A duplicate (step, rank, point, name), a bad point, a bad tensor: errors naming them."""
    rec = sd.Recorder(tmp_path / "r")
    rec.record("p", "w", np.zeros(2, np.float32))
    with pytest.raises(ValueError,
                       match=r"duplicate entry \(step 1, rank 0, point 'p', name 'w'\)"):
        rec.record("p", "w", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="'point'"):
        rec.record("a/b", "w", np.zeros(2, np.float32))
    with pytest.raises(TypeError, match=r"'tensor' \(p/c\) has dtype complex64"):
        rec.record("p", "c", np.zeros(2, np.complex64))
    with pytest.raises(TypeError, match="must be a torch tensor or a numpy array, got list"):
        rec.record("p", "l", [1.0])
    rec.next_step()
    rec.record("p", "w", np.ones(2, np.float32))  # the same name in the next step is fine
    rec.close()
    r = sd.read_recording(tmp_path / "r")
    assert [(e["step"], e["key"]) for e in r.entries] == [(1, "p/w"), (2, "p/w")]
    with pytest.raises(RuntimeError, match="closed"):
        rec.record("p", "x", np.ones(2, np.float32))


def test_recorder_refuses_a_non_empty_directory(tmp_path):
    """A non-empty directory is refused unless overwrite=True, which spares foreign files."""
    d = make_recording(tmp_path, "r")
    before = sorted(os.listdir(d))
    with pytest.raises(ValueError, match="exists and is not empty"):
        sd.Recorder(d)
    assert sorted(os.listdir(d)) == before
    rec = sd.Recorder(d, overwrite=True)
    assert sorted(os.listdir(d)) == ["entries.jsonl", "manifest.json"]
    rec.close()
    (tmp_path / "r" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a recording's"):
        sd.Recorder(d, overwrite=True)
    assert (tmp_path / "r" / "notes.txt").exists()
    with pytest.raises(ValueError, match="'run_metadata' must not set 'isa'"):
        sd.Recorder(tmp_path / "x", {"isa": "mine"})
    assert not (tmp_path / "x").exists()
    with pytest.raises(TypeError, match="'run_metadata'"):
        sd.Recorder(tmp_path / "x", {"f": object()})
    with pytest.raises(ValueError, match="'rank'"):
        sd.Recorder(tmp_path / "x", rank=-1)
    assert not (tmp_path / "x").exists()


def test_steps_scopes_and_begin_step(tmp_path):
    """step_scope(s) writes step s on exit; begin_step must go forward; rec.step counts."""
    rec = sd.Recorder(tmp_path / "r")
    assert rec.step == 1
    with rec.step_scope(3):
        assert rec.step == 3
        rec.record("p", "a", np.zeros(1, np.float32))
    assert rec.step == 4
    assert os.path.exists(tmp_path / "r" / "step000003-rank0.safetensors")
    with pytest.raises(ValueError, match="'step' 3 was already recorded"):
        rec.begin_step(3)
    rec.begin_step(7)
    rec.record("p", "a", np.zeros(1, np.float32))
    rec.flush()  # written, the step stays open
    rec.record("p", "b", np.zeros(1, np.float32))
    rec.close()
    header, _ = parse_by_hand(tmp_path / "r" / "step000007-rank0.safetensors")
    assert sorted(k for k in header if k != "__metadata__") == ["p/a", "p/b"]
    r = sd.read_recording(tmp_path / "r")
    assert [(e["step"], e["name"]) for e in r.entries] == [(3, "a"), (7, "a"), (7, "b")]


def test_manifest_is_replaced_atomically(tmp_path, monkeypatch):
    """manifest.json is never opened for writing: it is written as a temp file and renamed."""
    opened, replaced = [], []
    real_open, real_replace = builtins.open, os.replace

    def spy_open(file, mode="r", *a, **k):
        """open, noting the files opened for writing."""
        if any(c in mode for c in "wax+"):
            opened.append(os.path.basename(os.fspath(file)))
        return real_open(file, mode, *a, **k)

    def spy_replace(src, dst):
        """os.replace, noting the renames."""
        replaced.append((os.path.basename(os.fspath(src)), os.path.basename(os.fspath(dst))))
        return real_replace(src, dst)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "replace", spy_replace)
    rec = sd.Recorder(tmp_path / "r")
    rec.record("p", "w", np.zeros(2, np.float32))
    rec.next_step()
    rec.close()
    assert "manifest.json" not in opened and "manifest.json.tmp" in opened
    assert ("manifest.json.tmp", "manifest.json") in replaced
    assert ("step000001-rank0.safetensors.tmp", "step000001-rank0.safetensors") in replaced


CRASH = r"""
import os, sys, numpy as np, stepcore.diff as sd
rec = sd.Recorder(sys.argv[1])
for step in (1, 2):
    rec.record("p", "w", np.full(3, step, np.float32))
    rec.next_step()
rec.record("p", "w", np.full(3, 3, np.float32))  # step 3 never ends
os._exit(17)
"""


def test_a_crashed_run_leaves_a_valid_recording(tmp_path):
    """A process that dies in step 3 leaves a recording of steps 1 and 2 that compares."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    d = tmp_path / "crashed"
    p = subprocess.run([sys.executable, "-c", CRASH, str(d)], env=env, timeout=60)
    assert p.returncode == 17
    r = sd.read_recording(d)
    assert [(e["step"], e["name"]) for e in r.entries] == [(1, "w"), (2, "w")]
    assert r.get(2, "p", "w").tolist() == [2.0, 2.0, 2.0]
    rc, out, _ = run_cli(d, d)
    assert rc == 0 and out.strip().endswith("identical: 2 tensors")


def test_import_and_compare_never_import_torch(tmp_path):
    """stepcore.diff records numpy arrays and compares (through _core) without torch."""
    code = ("import sys, numpy as np, stepcore.diff as sd\n"
            f"rec = sd.Recorder({str(tmp_path / 'r')!r})\n"
            "rec.record('p', 'w', np.ones(2, np.float32)); rec.close()\n"
            f"assert sd.compare({str(tmp_path / 'r')!r}, {str(tmp_path / 'r')!r})['identical']\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print('ok')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    with open(tmp_path / "r" / "manifest.json") as f:
        assert "torch_version" not in json.load(f)["run"]


DTENSOR = r"""
import os, sys, torch, torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh
import stepcore.diff as sd
rank, world = int(sys.argv[2]), 2
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
dist.init_process_group("gloo", rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (world,))
full = torch.arange(10, dtype=torch.float32).reshape(5, 2)
dt = distribute_tensor(full, mesh, [Shard(0)])
cols = distribute_tensor(torch.arange(12, dtype=torch.float32).reshape(2, 6), mesh, [Shard(1)])
rec = sd.Recorder(sys.argv[1], {"world": world}, overwrite=True)
rec.record("after_step", "w", dt)
rec.record("after_step", "c", cols)
rec.next_step()
if rank == 1:
    rec.record("after_step", "only_rank1", torch.tensor([rank], dtype=torch.int64))
rec.close()
dist.destroy_process_group()
# Leave at once: gloo's threads can abort interpreter shutdown ("terminate called without
# an active exception", seen twice on a loaded 2-vCPU VM), and every result is written.
sys.stdout.flush()
os._exit(0)
"""


def test_dtensor_local_shards_on_two_gloo_processes(tmp_path):
    """2 processes: each rank's file holds its Shard(0) rows; rank 0's manifest lists both."""
    torch = pytest.importorskip("torch")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    d = tmp_path / "dt"
    procs = [subprocess.Popen([sys.executable, "-c", DTENSOR, str(d), str(r), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    r = sd.read_recording(d)
    assert [(e["step"], e["rank"], e["name"], e["shape"]) for e in r.entries] == \
        [(1, 0, "w", [3, 2]), (1, 0, "c", [2, 3]), (1, 1, "w", [2, 2]), (1, 1, "c", [2, 3]),
         (2, 1, "only_rank1", [1])]
    # each shard's placement: the whole's shape and the shard's offset in it
    assert [(e.get("global_shape"), e.get("global_offset")) for e in r.entries] == \
        [([5, 2], [0, 0]), ([2, 6], [0, 0]), ([5, 2], [3, 0]), ([2, 6], [0, 3]), (None, None)]
    full = np.arange(10, dtype=np.float32).reshape(5, 2)
    assert r.get(1, "after_step", "w", rank=0).tobytes() == full[:3].tobytes()
    assert r.get(1, "after_step", "w", rank=1).tobytes() == full[3:].tobytes()
    assert r.run["world"] == 2
    # Against one process holding the whole tensors: the shards are gathered by placement.
    one = tmp_path / "one"
    cols = np.arange(12, dtype=np.float32).reshape(2, 6)
    with sd.Recorder(one) as rec:
        rec.record("after_step", "w", full)
        rec.record("after_step", "c", cols)
    res = sd.compare(d, one)
    assert [(t["name"], t["rank"], t["status"], t["shape"]) for t in res["tensors"]] == \
        [("w", 0, "identical", [5, 2]), ("c", 0, "identical", [2, 6]),
         ("only_rank1", 1, "missing_in_b", [1])]
    # One element differs: global (4, 1) of w, in rank 1's shard at (1, 1); (1, 4) of c.
    other = tmp_path / "other"
    w2, c2 = full.copy(), cols.copy()
    w2[4, 1] = np.nextafter(w2[4, 1], np.float32(100))
    c2[1, 4] = -c2[1, 4]
    with sd.Recorder(other) as rec:
        rec.record("after_step", "w", w2)
        rec.record("after_step", "c", c2)
    res = sd.compare(d, other)
    w_t, c_t = res["tensors"][0], res["tensors"][1]
    assert (w_t["status"], w_t["differing"], w_t["first_index"], w_t["max_ulps"]) == \
        ("different", 1, 9, 1)
    assert (c_t["status"], c_t["differing"], c_t["first_index"]) == ("different", 1, 10)
    assert res["first_divergence"] == {"step": 1, "point": "after_step", "name": "w", "rank": 0}
    rc, out, _ = run_cli(d, other)
    assert rc == 1 and "9 (4,1)" in out and "10 (1,4)" in out, out


def test_an_extension_without_the_comparer_says_so(tmp_path, monkeypatch):
    """Built without nlohmann-json (STEPCORE_DIFF=AUTO on a bare machine) _core has no
    diff_compare: compare raises ImportError naming what is missing; recording works."""
    monkeypatch.delattr(stepcore._core, "diff_compare")
    with sd.Recorder(tmp_path / "r") as rec:
        rec.record("p", "w", np.ones(2, np.float32))
    with pytest.raises(ImportError, match="built without the comparer.*nlohmann-json"):
        sd.compare(tmp_path / "r", tmp_path / "r")


def test_shard_placement_arguments_are_checked(tmp_path):
    """record(global_shape=, global_offset=): lists of the shard's rank holding it inside."""
    rec = sd.Recorder(tmp_path / "r")
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="'global_shape' must be a list of 2"):
        rec.record("p", "x", x, global_shape=[4], global_offset=[0, 0])
    with pytest.raises(ValueError, match="'global_offset' must be a list of 2"):
        rec.record("p", "x", x, global_shape=[4, 3], global_offset=[0, -1])
    with pytest.raises(ValueError, match="outside 'global_shape'"):
        rec.record("p", "x", x, global_shape=[4, 3], global_offset=[3, 0])
    rec.record("p", "x", x, global_shape=[2, 3], global_offset=[0, 0])
    rec.close()
    e = sd.read_recording(tmp_path / "r").entries[0]
    assert (e["global_shape"], e["global_offset"]) == ([2, 3], [0, 0])


def journal_sizes(d, steps, per_step):
    """Records `steps` steps of `per_step` tensors; returns the journal's size after each."""
    sizes = []
    with sd.Recorder(d) as rec:
        for step in range(1, steps + 1):
            for i in range(per_step):
                rec.record("p", f"t{i}", np.full(3, step, np.float32))
            rec.next_step()
            sizes.append(os.path.getsize(os.path.join(d, "entries.jsonl")))
    return sizes


def test_the_recorder_appends_each_step_to_its_journal(tmp_path, monkeypatch):
    """200 steps: each appends its own entries (a constant number of bytes, one write and
    one fsync), and manifest.json is written once, not per step."""
    replaced, fsyncs = [], []
    real_replace, real_fsync = os.replace, os.fsync
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append(os.path.basename(b)),
                                                     real_replace(a, b))[1])
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    d = str(tmp_path / "r")
    sizes = journal_sizes(d, 200, 3)
    growth = [b - a for a, b in zip([0] + sizes, sizes)]
    # 3 lines a step; they differ only in the step's digits ("step": 7 vs 123): 3 x 2 bytes
    assert min(growth) > 0 and max(growth) - min(growth) <= 6, (min(growth), max(growth))
    assert replaced.count("manifest.json") == 1
    # per step: the step's file and one journal append
    assert replaced.count("step000200-rank0.safetensors") == 1 and len(fsyncs) <= 2 * 200 + 3
    r = sd.read_recording(d)
    assert len(r.entries) == 600 and r.get(200, "p", "t2").tolist() == [200.0] * 3


def test_a_torn_journal_tail_is_not_yet_written(tmp_path):
    """A last line without its newline (an append cut short) is ignored by both readers;
    a complete bad line is a FormatError naming the journal and the line."""
    d = tmp_path / "r"
    with sd.Recorder(d) as rec:
        for step in (1, 2):
            rec.record("p", "w", np.full(2, step, np.float32))
            rec.next_step()
    journal = d / "entries.jsonl"
    text = journal.read_text()
    lines = text.splitlines(keepends=True)
    for cut in range(len(lines[1])):
        journal.write_text(lines[0] + lines[1][:cut])
        assert [e["step"] for e in sd.read_recording(d).entries] == [1]
        assert sd.compare(d, d)["summary"]["tensors"] == 1
    journal.write_text(lines[0] + "{oops\n" + lines[1])
    with pytest.raises(sd.FormatError, match="line 2"):
        sd.read_recording(d)
    with pytest.raises(sd.FormatError, match="entries.jsonl: line 2 of the journal is not"):
        sd.compare(d, d)
    journal.write_text(text)
    assert sd.compare(d, d)["summary"]["identical"] == 2


def test_a_version_1_recording_is_still_read(tmp_path):
    """A recording whose manifest.json lists the entries (version 1) compares as before."""
    d = tmp_path / "v1"
    with sd.Recorder(d) as rec:
        rec.record("p", "w", np.arange(3, dtype=np.float32))
    entries = [json.loads(line) for line in (d / "entries.jsonl").read_text().splitlines()]
    m = json.loads((d / "manifest.json").read_text())
    (d / "entries.jsonl").unlink()
    (d / "manifest.json").write_text(json.dumps({"format": m["format"], "version": 1,
                                                  "run": m["run"], "entries": entries}))
    assert sd.read_recording(d).entries[0]["name"] == "w"
    r = sd.compare(d, d)
    assert (r["identical"], r["summary"]["tensors"]) == (True, 1)


TRUNCATE = r"""
import os, random, sys, threading, time
import stepcore.diff as sd
a, b, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = open(b, "rb").read()
rng = random.Random(27)
counts = {"compared": 0, "error": 0}
for run in range(runs):
    with open(a, "wb") as f:
        f.write(data)
    cut = rng.randrange(len(data))
    delay = rng.random() * 0.004
    t = threading.Thread(target=lambda: (time.sleep(delay), os.truncate(a, cut)))
    t.start()
    try:
        r = sd.compare(a, b)
        assert r["identical"], r["summary"]  # a comparison that ran read the whole file
        counts["compared"] += 1
    except sd.FormatError as e:
        assert a in str(e), e
        counts["error"] += 1
    t.join()
print(counts["compared"], counts["error"])
"""


def test_a_file_truncated_while_compared_raises_never_crashes(tmp_path):
    """A truncated file is a FormatError naming it; 300 truncations racing the comparer (the
    GIL released) in a child process: each an error or a whole comparison, never a signal."""
    tensors = [(f"t{i}", "F32", [65536], np.arange(65536, dtype=np.uint32).tobytes())
               for i in range(4)]
    b = craft(tmp_path / "b.safetensors", tensors)
    a = str(tmp_path / "a.safetensors")
    with open(b, "rb") as f:
        data = f.read()
    with open(a, "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(sd.FormatError, match="a.safetensors"):
        sd.compare(a, b)
    rc, out, err = run_cli(a, b)
    assert rc == 2 and a in err
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    p = subprocess.run([sys.executable, "-c", TRUNCATE, a, b, "300"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    compared, errors = map(int, p.stdout.split())
    assert compared + errors == 300 and errors > 0, p.stdout


# ---- the C++ comparer, when it is built -------------------------------------------------


def cpp_diff():
    """Path of a stepcore-diff binary (STEPCORE_DIFF, PATH, build/*/apps), or None."""
    env = os.environ.get("STEPCORE_DIFF")
    if env:
        return env
    found = shutil.which("stepcore-diff")
    if found:
        return found
    built = sorted(glob.glob(os.path.join(ROOT, "build", "*", "apps", "stepcore-diff")))
    return built[0] if built else None


COMPARED = ("step", "rank", "point", "name", "key", "status", "dtype", "shape", "elements",
            "differing", "max_ulps", "median_ulps", "first_index", "a_hex", "b_hex",
            "nan_vs_number", "nan_payload", "signed_zero", "inf")


def test_cpp_stepcore_diff_agrees_on_the_crafted_cases(tmp_path):
    """The C++ tool's --json: same statuses, counts, ulps, first divergence, exit status."""
    exe = cpp_diff()
    if exe is None:
        pytest.skip("no C++ stepcore-diff binary (STEPCORE_DIFF, PATH or "
                    "build/*/apps/stepcore-diff)")
    for name, (a, b, max_ulps) in crafted_cases(tmp_path).items():
        p = subprocess.run([exe, a, b, "--json", "--max-ulps", str(max_ulps)],
                           capture_output=True, text=True, timeout=120)
        want = sd.compare(a, b, max_ulps=max_ulps)
        assert p.returncode == want["exit_status"], (name, p.stderr)
        got = json.loads(p.stdout)
        assert got["exit_status"] == want["exit_status"], name
        assert got["identical"] == want["identical"], name
        assert got["first_divergence"] == want["first_divergence"], name
        assert got["summary"] == want["summary"], name
        assert [{k: t[k] for k in COMPARED} for t in got["tensors"]] == \
            [{k: t[k] for k in COMPARED} for t in want["tensors"]], name
    bad = craft(tmp_path / "bad.safetensors", [], header={"x": entry(offs=(8, 0))},
                data=b"\0" * 8)
    p = subprocess.run([exe, bad, good_file(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and bad in p.stderr
