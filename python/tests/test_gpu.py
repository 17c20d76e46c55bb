"""stepcore.gpu, the GPU launchers from Python. Without a GPU: the stream argument (int,
__cuda_stream__, None) and every argument check (CPU memory, sizes, dtypes, alignment,
devices) named and changing nothing, through arrays that describe host memory to DLPack as
CUDA memory; the bias table, the read-back helpers and the device partial's all-reduce
layout on the host. With a GPU (marked gpu): every launcher against the CPU engine, bit for
bit, on torch CUDA tensors and streams."""

import ctypes
import importlib
import math
import subprocess
import sys

import numpy as np
import pytest

import stepcore
import stepcore._core as core
import stepcore.gpu as sc

# ---- arrays in "CUDA memory" without a GPU --------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DL_CODES = {"i": 0, "u": 1, "f": 2}
_DL_CUDA = 2


class FakeCuda:
    """A numpy array's host memory described to DLPack as CUDA memory of `device_id`: the
    binding's checks run on it as on a device array. The library's own pointer check then
    refuses it (a host pointer), so nothing is ever launched on it."""

    def __init__(self, array, device_id=0):
        self.array = array
        self.device_id = device_id
        self._keep = []  # the DLPack structs of the capsules handed out

    def __dlpack_device__(self):
        return (_DL_CUDA, self.device_id)

    def __dlpack__(self, **kwargs):
        a = self.array
        dims = max(1, a.ndim)
        shape = (ctypes.c_int64 * dims)(*a.shape)
        strides = (ctypes.c_int64 * dims)(*[s // a.itemsize for s in a.strides])
        mt = _DLManagedTensor()
        mt.dl_tensor.data = a.ctypes.data
        mt.dl_tensor.device = _DLDevice(_DL_CUDA, self.device_id)
        mt.dl_tensor.ndim = a.ndim
        mt.dl_tensor.dtype = _DLDataType(_DL_CODES[a.dtype.kind], a.dtype.itemsize * 8, 1)
        mt.dl_tensor.shape = shape
        mt.dl_tensor.strides = strides
        self._keep.append((mt, shape, strides))
        return _capsule_new(ctypes.addressof(mt), b"dltensor", None)


def fake(array, device_id=0):
    return FakeCuda(np.ascontiguousarray(array) if array.ndim else array, device_id)


def f32(*values):
    return np.array(values, np.float32)


PARTIAL = sc.NORM_PARTIAL_BYTES
RESULT = sc.NORM_RESULT_BYTES
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
ADAMW = "optimizer_step(adamw)"  # valid_calls() keys of the optimizer launcher
SIGN_SGD = "optimizer_step(sign_sgd)"


def valid_calls():
    """Every launcher with valid arguments in fake CUDA memory, by keyword: name -> kwargs."""
    n = 5
    t = lambda: fake(np.linspace(-1, 1, n, dtype=np.float32))  # noqa: E731
    ws = lambda: fake(np.zeros(sc.scale_and_norm_workspace_bytes([np.zeros(n, np.float32)]),  # noqa: E731
                               np.uint8))
    part = lambda: fake(np.zeros(PARTIAL, np.uint8))  # noqa: E731
    table = sc.make_optimizer_table("adamw", HYPER)
    return {
        "scale_and_norm_partial": dict(tensors=[t(), t()], scale=0.5, partial=part(), workspace=ws()),
        "norm_partial": dict(tensors=[t()], partial=part(), workspace=ws(), grad_scale=0.5),
        "scale_": dict(tensors=[t()], factor=fake(f32(0.5))),
        "accumulate": dict(accs=[t()], srcs=[t()]),
        "finalize_and_clip": dict(partial=part(), max_norm=1.0, result=fake(np.zeros(RESULT, np.uint8)),
                                  clip=fake(f32(0)), found_inf=fake(np.zeros(1, np.int32))),
        "exact_norm_partial_if_needed": dict(tensors=[t()], found_inf=fake(np.zeros(1, np.int32)),
                                             exact_partial=part(), workspace=ws()),
        "finalize_exact_and_clip": dict(exact_partial=part(), max_norm=1.0,
                                        result=fake(np.zeros(RESULT // 8, np.int64)),
                                        clip=fake(f32(0)), found_inf=fake(np.zeros((), np.int32))),
        "optimizer_step(adamw)": dict(
            optimizer="adamw", params=[t()], states=[[t()], [fake(np.ones(n, np.float32))]],
            steps=[fake(np.zeros((), np.float32))], grads=[t()], computes=[t()], hyper=dict(HYPER),
            scale=fake(f32(1)), clip=fake(f32(1)), table=fake(table),
            found_inf=fake(np.zeros(1, np.int32)), step_hyper=fake(np.array([1e-3, 0.01]))),
        "optimizer_step(sign_sgd)": dict(
            optimizer="sign_sgd", params=[t()], states=[], steps=None, grads=[t()], computes=[t()],
            hyper=dict(lr=1e-3), found_inf=fake(np.zeros(1, np.int32)),
            step_hyper=fake(np.array([1e-3, 0.0]))),
    }


def arrays_of(kwargs):
    """(python name, FakeCuda) of every array argument, lists' entries named base[i] (lists
    of lists: base[i][j])."""
    out = []

    def walk(name, v):
        if isinstance(v, FakeCuda):
            out.append((name, v))
        elif isinstance(v, list):
            for i, a in enumerate(v):
                walk(f"{name}[{i}]", a)

    for k, v in kwargs.items():
        walk(k, v)
    return out


def set_arg(kwargs, arg, value):
    """Replaces the argument named `arg` as arrays_of names it ("grads[0]", "states[1][0]")."""
    key, *indices = arg.replace("]", "").split("[")
    if not indices:
        kwargs[key] = value
        return
    target = kwargs[key]
    for i in indices[:-1]:
        target = target[int(i)]
    target[int(indices[-1])] = value


def snapshot(kwargs):
    return [a.array.tobytes() for _, a in arrays_of(kwargs)]


def launcher(name):
    """The launcher of a valid_calls() entry: "optimizer_step(adamw)" -> sc.optimizer_step."""
    return getattr(sc, name.split("(")[0])


def launch(name, kwargs):
    # A FakeCuda reports no current stream (no DLPack C exchange API): stream=None with it
    # is refused (test_stream_none_needs_a_current_stream), so the launches name one.
    return launcher(name)(**{"stream": 0, **kwargs})


def refused_on_the_host():
    """What a launch on fake CUDA memory that passed the binding's checks raises: the
    library's pointer check (ValueError), or NotImplementedError when built without CUDA."""
    return ValueError if sc.built_with_cuda() else NotImplementedError


# ---- built_with_cuda, the import ------------------------------------------------------


def test_built_with_cuda_is_reported_and_the_launchers_follow_it():
    assert isinstance(sc.built_with_cuda(), bool)
    assert sc.built_with_cuda() == core.gpu.built_with_cuda()
    assert sc.device_count() >= 0
    assert (sc.device_count() == 0) == (sc.unavailable_reason() != "")
    if sc.built_with_cuda():
        sc.accumulate([], [])  # nothing to launch: no CUDA call at all
    else:
        assert sc.device_count() == 0
        with pytest.raises(NotImplementedError, match="without CUDA"):
            sc.accumulate([], [])
    print(f"stepcore built with CUDA: {sc.built_with_cuda()}; devices: {sc.device_count()} "
          f"{sc.unavailable_reason()}")


def test_import_stepcore_gpu_does_not_import_torch():
    code = "import sys, stepcore, stepcore.gpu; print('torch' in sys.modules, stepcore.gpu is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_the_old_module_name_is_gone_without_an_alias():
    # Renamed stepcore.gpu (docs/python.md, "GPU launchers"): no second name for it.
    assert not hasattr(stepcore, "cuda") and not hasattr(core, "cuda")
    assert stepcore.gpu is sc and "gpu" in stepcore.__all__ and "cuda" not in stepcore.__all__
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("stepcore.cuda")


# ---- streams ----------------------------------------------------------------------------


class Stream:
    def __init__(self, value):
        self.value = value

    def __cuda_stream__(self):
        return self.value


def test_stream_addresses():
    assert core._stream_address(None) == 0
    assert core._stream_address(0) == 0
    assert core._stream_address(0x7F00DEADBEEF) == 0x7F00DEADBEEF
    assert core._stream_address(2**64 - 1) == 2**64 - 1
    assert core._stream_address(Stream((0, 1234))) == 1234
    assert core._stream_address(Stream((0, 0))) == 0


@pytest.mark.parametrize("stream, exc, match", [
    (Stream((1, 1234)), TypeError, "version must be 0"),
    (Stream((0, "x")), TypeError, "is not a CUDA stream"),
    (Stream(1234), TypeError, "tuple"),
    (Stream((0, 1, 2)), TypeError, "tuple"),
    ("stream", TypeError, "a str is not a CUDA stream"),
    (1.5, TypeError, "a float is not a CUDA stream"),
    (True, TypeError, "a bool is not a CUDA stream"),
    (-1, ValueError, "negative"),
    (2**64, ValueError, "wider than 64 bits"),
])
def test_bad_streams_are_refused_naming_stream(stream, exc, match):
    with pytest.raises(exc, match=match) as info:
        core._stream_address(stream)
    assert "'stream'" in str(info.value)
    # Through a launcher, before any array is looked at (its CPU arrays would be refused).
    acc, src = np.zeros(4, np.float32), np.ones(4, np.float32)
    with pytest.raises(exc, match=match) as info:
        sc.accumulate([acc], [src], stream=stream)
    assert "'stream'" in str(info.value)
    assert not acc.any()


@pytest.mark.parametrize("stream", [None, 0, 0x1234, Stream((0, 0x1234))])
@pytest.mark.parametrize("name", sorted(valid_calls()))
def test_a_valid_stream_reaches_the_array_checks(name, stream):
    kwargs = valid_calls()[name]
    first, arr = arrays_of(kwargs)[0]
    set_arg(kwargs, first, arr.array)  # a CPU array where device memory is needed
    before = snapshot(kwargs) + [arr.array.tobytes()]
    with pytest.raises(ValueError, match="must be CUDA device memory") as info:
        launch(name, dict(kwargs, stream=stream))
    assert f"'{first}'" in str(info.value)
    assert snapshot(kwargs) + [arr.array.tobytes()] == before


def test_stream_none_with_a_torch_cpu_tensor_reaches_the_array_checks():
    torch = pytest.importorskip("torch")
    # The producer is a CPU tensor: no current CUDA stream to ask torch for (no CUDA call).
    acc = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'accs\[0\]'"):
        sc.accumulate([acc], [torch.ones(3)])
    assert not acc.any()


@pytest.mark.parametrize("name", sorted(valid_calls()))
def test_stream_none_needs_a_current_stream(name):
    # A producer in CUDA memory whose framework cannot report its current stream: the
    # launch is refused naming 'stream' before anything runs, instead of going to the
    # legacy default stream (unordered with the framework's current stream).
    kwargs = valid_calls()[name]
    before = snapshot(kwargs)
    with pytest.raises(ValueError, match="reports no current stream") as info:
        launcher(name)(**kwargs)  # stream=None
    assert "'stream'" in str(info.value)
    assert snapshot(kwargs) == before
    producer = arrays_of(kwargs)[0][1]
    with pytest.raises(ValueError, match="'stream'"):
        core._launch_stream(None, producer)
    assert core._launch_stream(0x1234, producer) == 0x1234
    # Nothing to order with: no producer, or one in host memory (refused by its own check).
    assert core._launch_stream(None, None) == 0
    assert core._launch_stream(None, np.zeros(3, np.float32)) == 0


def test_stream_none_with_a_torch_tensor_without_the_exchange_api_is_torchs_current(monkeypatch):
    torch = pytest.importorskip("torch")

    class OldTorchTensor(torch.Tensor):
        """A torch CUDA tensor of a torch without the DLPack C exchange API (< 2.9)."""
        __dlpack_c_exchange_api__ = None

        def __dlpack_device__(self):
            return (_DL_CUDA, 0)

    class Current:
        cuda_stream = 0x5EED

    asked = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: asked.append(device) or Current())
    t = torch.zeros(3).as_subclass(OldTorchTensor)
    assert core._launch_stream(None, t) == 0x5EED
    assert asked == [0]
    assert core._launch_stream(7, t) == 7  # a given stream is used as it is


# ---- every argument checked, named, nothing written -----------------------------------


@pytest.mark.parametrize("name", sorted(valid_calls()))
def test_valid_arguments_reach_the_library_which_refuses_host_memory(name):
    kwargs = valid_calls()[name]
    before = snapshot(kwargs)
    with pytest.raises(refused_on_the_host()):
        launch(name, kwargs)
    assert snapshot(kwargs) == before


def spoil_cases():
    for name, kwargs in sorted(valid_calls().items()):
        for arg, _ in arrays_of(kwargs):
            yield name, arg


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("name, arg", list(spoil_cases()))
def test_a_cpu_array_is_refused_naming_it_and_nothing_is_written(name, arg, kind):
    kwargs = valid_calls()[name]
    target = dict(arrays_of(kwargs))[arg]
    host = target.array
    if kind == "torch":
        torch = pytest.importorskip("torch")
        host = torch.from_numpy(host)  # the same memory, through the DLPack C exchange API
    set_arg(kwargs, arg, host)
    before = snapshot(kwargs) + [target.array.tobytes()]
    with pytest.raises(ValueError, match="must be CUDA device memory") as info:
        launch(name, kwargs)
    assert f"'{arg}'" in str(info.value)
    assert snapshot(kwargs) + [target.array.tobytes()] == before


def bad_buffer_cases():
    """(launcher, argument, replacement, exception, message)."""
    u8 = lambda n: np.zeros(n, np.uint8)  # noqa: E731
    misaligned = np.zeros(PARTIAL + 8, np.uint8)[1:PARTIAL + 1]
    return [
        ("scale_and_norm_partial", "partial", u8(PARTIAL - 1), ValueError, "183 bytes"),
        ("scale_and_norm_partial", "partial", u8(PARTIAL + 8), ValueError, "192 bytes, not 184"),
        ("scale_and_norm_partial", "partial", np.zeros(PARTIAL // 4, np.float32), TypeError,
         "int64 or uint8"),
        ("scale_and_norm_partial", "partial", misaligned, ValueError, "aligned"),
        ("norm_partial", "partial", np.zeros(PARTIAL // 4, np.int32), TypeError, "int64 or uint8"),
        ("exact_norm_partial_if_needed", "exact_partial", u8(1), ValueError, "1 bytes"),
        ("finalize_and_clip", "partial", np.zeros(PARTIAL // 8 - 1, np.int64), ValueError,
         "176 bytes"),
        ("finalize_and_clip", "result", u8(RESULT + 1), ValueError, "NORM_RESULT_BYTES"),
        ("finalize_and_clip", "clip", f32(1, 2), ValueError, "2 elements"),
        ("finalize_and_clip", "clip", np.zeros(1, np.float64), TypeError, "float32"),
        ("finalize_and_clip", "found_inf", np.zeros(1, np.int64), TypeError, "int32"),
        ("finalize_and_clip", "found_inf", np.zeros(0, np.int32), ValueError, "0 elements"),
        ("finalize_exact_and_clip", "exact_partial", u8(PARTIAL * 2), ValueError, "368 bytes"),
        ("scale_", "factor", np.zeros(1, np.int32), TypeError, "float32"),
        (ADAMW, "scale", f32(), ValueError, "0 elements"),
        (ADAMW, "clip", np.zeros(1, np.float16), TypeError, "float32"),
        (ADAMW, "steps[0]", f32(0, 0), ValueError, "2 elements"),
        (ADAMW, "states[1][0]", np.zeros(5, np.float64), TypeError, "float32, bfloat16"),
        (ADAMW, "found_inf", np.zeros(1, np.uint8), TypeError, "int32"),
        (ADAMW, "step_hyper", np.zeros(3), ValueError, "3 elements"),
        (ADAMW, "step_hyper", np.zeros(2, np.float32), TypeError, "float64"),
        (ADAMW, "table", np.zeros(2), ValueError, "length"),
        (ADAMW, "table", sc.make_optimizer_table("adamw", dict(beta1=0.5, beta2=0.99)),
         ValueError, "length"),
        (ADAMW, "table", sc.make_optimizer_table("adamw", HYPER).astype(np.float32),
         TypeError, "float64"),
        (SIGN_SGD, "step_hyper", np.zeros(1), ValueError, "1 elements"),
        (SIGN_SGD, "found_inf", np.zeros(1, np.float32), TypeError, "int32"),
        (ADAMW, "grads[0]", np.zeros(5, np.float64), TypeError, "float32, bfloat16"),
        ("accumulate", "srcs[0]", np.zeros((5, 2), np.float32)[:, 0], ValueError, "C-contiguous"),
    ]


@pytest.mark.parametrize("name, arg, bad, exc, match", bad_buffer_cases())
def test_a_bad_device_buffer_is_refused_naming_it_and_nothing_is_written(name, arg, bad, exc, match):
    kwargs = valid_calls()[name]
    set_arg(kwargs, arg, FakeCuda(bad))
    before = snapshot(kwargs)
    with pytest.raises(exc, match=match) as info:
        launch(name, kwargs)
    assert f"'{arg}'" in str(info.value)
    assert snapshot(kwargs) == before


def test_arrays_on_two_devices_are_refused_naming_the_second():
    kwargs = valid_calls()[ADAMW]
    kwargs["grads"] = [FakeCuda(np.zeros(5, np.float32), device_id=1)]
    before = snapshot(kwargs)
    with pytest.raises(ValueError, match=r"'grads\[0\]': is on CUDA device 1 but 'params\[0\]'"):
        launch(ADAMW, kwargs)
    assert snapshot(kwargs) == before


def test_list_lengths_and_a_read_only_output_are_refused():
    kwargs = valid_calls()[ADAMW]
    kwargs["steps"] = []
    with pytest.raises(ValueError, match="'steps'"):
        launch(ADAMW, kwargs)
    kwargs = valid_calls()[ADAMW]
    kwargs["states"][1] = []
    with pytest.raises(ValueError, match=r"'states\[1\]'"):
        launch(ADAMW, kwargs)
    kwargs = valid_calls()["accumulate"]
    kwargs["srcs"] = kwargs["srcs"] * 2
    with pytest.raises(ValueError, match="'srcs'"):
        launch("accumulate", kwargs)
    kwargs = valid_calls()[SIGN_SGD]
    kwargs["computes"] = []
    with pytest.raises(ValueError, match="'computes'"):
        launch(SIGN_SGD, kwargs)


@pytest.mark.parametrize("name, key, value, match", [
    (ADAMW, "lr", float("nan"), "'lr'"),
    (ADAMW, "beta1", 1.0, "'beta1'"),
    (ADAMW, "formula", "fused", "'formula'"),
    (SIGN_SGD, "weight_decay", -1.0, "'weight_decay'"),
    ("finalize_and_clip", "max_norm", -1.0, "max_norm"),
    ("scale_and_norm_partial", "scale", float("inf"), "'scale'"),
    ("norm_partial", "clip", 2.0, "'clip'"),
])
def test_bad_hyper_parameters_are_refused_with_python_names(name, key, value, match):
    kwargs = valid_calls()[name]
    if "hyper" in kwargs:  # an optimizer's hyper-parameters: the `hyper` dict
        kwargs["hyper"] = dict(kwargs["hyper"], **{key: value})
    else:
        kwargs[key] = value
    before = snapshot(kwargs)
    # The CUDA library validates every scalar; without CUDA only what the binding reads
    # itself is checked before NotImplementedError: an optimizer's configuration, which the
    # table's length check builds (validating it).
    checked = sc.built_with_cuda() or "hyper" in kwargs
    with pytest.raises(ValueError if checked else NotImplementedError) as info:
        launch(name, kwargs)
    if checked:
        assert match in str(info.value)
    assert snapshot(kwargs) == before


def device_reads():
    """The norm passes' per-step scalars as float32 device arrays (read when the kernels
    run, so a captured graph replays with the values there at replay)."""
    return {
        "scale_and_norm_partial": dict(scale=fake(f32(0.5))),
        "norm_partial": dict(grad_scale=fake(f32(0.5)), clip=fake(f32(0.75))),
        "exact_norm_partial_if_needed": dict(grad_scale=fake(f32(0.5)), clip=fake(f32(0.75))),
    }


@pytest.mark.parametrize("name", sorted(device_reads()))
def test_the_norm_passes_take_their_scalars_in_device_memory(name):
    kwargs = dict(valid_calls()[name], **device_reads()[name])
    before = snapshot(kwargs)
    with pytest.raises(refused_on_the_host()):
        launch(name, kwargs)
    assert snapshot(kwargs) == before


@pytest.mark.parametrize("name", sorted(device_reads()))
@pytest.mark.parametrize("how, exc, match", [
    ("cpu", ValueError, "must be CUDA device memory"),
    ("float64", TypeError, "is not float32"),
    ("two values", ValueError, "has 2 elements, not 1"),
    ("str", TypeError, "a str is neither a number nor a float32 device array"),
])
def test_device_scalars_of_the_norm_passes_are_checked_and_named(name, how, exc, match):
    kwargs = dict(valid_calls()[name], **device_reads()[name])
    key = "scale" if name == "scale_and_norm_partial" else "grad_scale"
    kwargs[key] = {"cpu": f32(0.5), "float64": fake(np.array([0.5])),
                   "two values": fake(f32(0.5, 0.5)), "str": "0.5"}[how]
    before = snapshot(kwargs)
    with pytest.raises(exc, match=match) as info:
        launch(name, kwargs)
    assert f"'{key}'" in str(info.value)
    assert snapshot(kwargs) == before


@pytest.mark.parametrize("name", ["norm_partial", "exact_norm_partial_if_needed"])
@pytest.mark.parametrize("number", ["grad_scale", "clip"])
def test_a_gradient_read_is_all_in_device_memory_or_all_numbers(name, number):
    kwargs = dict(valid_calls()[name], **device_reads()[name])
    kwargs[number] = 1.0
    before = snapshot(kwargs)
    with pytest.raises(ValueError, match="is a number while") as info:
        launch(name, kwargs)
    assert f"'{number}'" in str(info.value)
    assert snapshot(kwargs) == before


def test_a_too_small_workspace_is_named():
    kwargs = valid_calls()["scale_and_norm_partial"]
    kwargs["workspace"] = FakeCuda(np.zeros(8, np.uint8))
    before = snapshot(kwargs)
    with pytest.raises(ValueError if sc.built_with_cuda() else NotImplementedError) as info:
        launch("scale_and_norm_partial", kwargs)
    if sc.built_with_cuda():
        assert "'workspace'" in str(info.value) and "scale_and_norm_workspace_bytes" in str(info.value)
    assert snapshot(kwargs) == before


# ---- host-side helpers ------------------------------------------------------------------


def test_workspace_bytes_count_blocks_of_each_tensor():
    b = sc.BLOCK_ELEMENTS
    sizes = [0, 1, b, b + 1, 3 * b - 1]
    blocks = sum(-(-n // b) for n in sizes)
    arrays = [np.zeros(n, np.float32) for n in sizes]
    assert sc.scale_and_norm_workspace_bytes(arrays) == blocks * PARTIAL
    assert sc.scale_and_norm_workspace_bytes([FakeCuda(a) for a in arrays]) == blocks * PARTIAL
    assert sc.scale_and_norm_workspace_bytes([]) == 0


@pytest.mark.parametrize("formula", ["torch", "native"])
def test_the_bias_table_is_the_hosts_pow(formula):
    b1, b2 = 0.9, 0.999
    t = sc.make_optimizer_table("adamw", dict(beta1=b1, beta2=b2, formula=formula))
    assert t.dtype == np.float64 and t.ndim == 1
    len1, len2 = int(t[0]), int(t[1])
    assert t.size == 2 + len1 + len2
    if formula == "native":  # the native formula raises its f32-rounded betas
        b1, b2 = float(np.float32(b1)), float(np.float32(b2))
    want1 = [1.0 - math.pow(b1, k) for k in range(1, len1 + 1)]
    want2 = [1.0 - math.pow(b2, k) for k in range(1, len2 + 1)]
    assert t[2:2 + len1].tobytes() == np.array(want1).tobytes()
    assert t[2 + len1:].tobytes() == np.array(want2).tobytes()
    assert 1.0 - math.pow(b1, len1 + 1) == 1.0 and 1.0 - math.pow(b2, len2 + 1) == 1.0


def test_the_bias_table_refuses_bad_betas_naming_them():
    with pytest.raises(ValueError, match="'beta2'"):
        sc.make_optimizer_table("adamw", dict(beta2=1.5))
    with pytest.raises(NotImplementedError, match="'beta1'"):
        sc.make_optimizer_table("adam", dict(beta1=1.0 - 1e-7))
    with pytest.raises(ValueError, match="'formula'"):
        sc.make_optimizer_table("adamw", dict(formula="fused"))
    with pytest.raises(ValueError, match="'optimizer'"):
        sc.make_optimizer_table("adamax")


@pytest.mark.parametrize("name", stepcore.optimizers())
def test_every_optimizer_has_a_table_or_none(name):
    # AdamW and Adam: their bias corrections; the others compute every value themselves.
    t = sc.make_optimizer_table(name)
    assert t.dtype == np.float64 and t.ndim == 1
    assert (t.size > 0) == (name in ("adamw", "adam"))


def test_a_table_for_an_optimizer_without_one_is_refused():
    kwargs = valid_calls()[SIGN_SGD]
    kwargs["table"] = fake(sc.make_optimizer_table("adamw"))
    before = snapshot(kwargs)
    with pytest.raises(ValueError, match="has no table") as info:
        launch(SIGN_SGD, kwargs)
    assert "'table'" in str(info.value)
    assert snapshot(kwargs) == before
    kwargs = valid_calls()[ADAMW]
    kwargs["table"] = None
    with pytest.raises(ValueError, match="required") as info:
        launch(ADAMW, kwargs)
    assert "'table'" in str(info.value)


def partial_struct(words):
    """The device NormPartial (NORM_PARTIAL_BYTES) of a 24-word partial."""
    k = stepcore.PARTIAL_MAX_ABS_WORD
    raw = np.zeros(PARTIAL // 8, np.int64)
    raw[:sc.PARTIAL_SUM_WORDS] = words[:sc.PARTIAL_SUM_WORDS]
    as32 = raw.view(np.int32)
    as32[sc.PARTIAL_MAX_INT32] = words[k]
    as32[sc.PARTIAL_MAX_INT32 + 1] = words[k + 1]
    return raw.view(np.uint8)


def test_partial_words_read_the_device_layout():
    rng = np.random.default_rng(3)
    e = stepcore.Engine(threads=1)
    g = (rng.standard_normal(999) * 1e3).astype(np.float32)
    g[7] = np.inf
    for exact in (False, True):
        words = e.norm_partial([g], exact=exact)
        raw = partial_struct(words)
        assert np.array_equal(sc.partial_words(raw), words)
        assert np.array_equal(sc.partial_words(raw.view(np.int64)), words)
        assert np.array_equal(sc.read_partial(raw), words)  # numpy: already on the host
    with pytest.raises(ValueError, match="'partial'.*must be CPU memory"):
        sc.partial_words(FakeCuda(raw))
    with pytest.raises(ValueError, match="'partial'.*183 bytes"):
        sc.partial_words(raw[:-1])


def test_the_device_partials_all_reduce_layout_is_exact():
    """SUM of int64 words [0, PARTIAL_SUM_WORDS), MAX of the int32 pair at PARTIAL_MAX_INT32
    (max_abs_bits, approximate): the combined struct is the whole data's partial."""
    rng = np.random.default_rng(5)
    e = stepcore.Engine(threads=1)
    shards = [(rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20)).astype(np.float32)
              for n in (100, 0, 3000, 7)]
    for exact in (False, True):
        structs = [partial_struct(e.norm_partial([s], exact=exact)).view(np.int64) for s in shards]
        combined = structs[0].copy()
        for s in structs[1:]:
            combined[:sc.PARTIAL_SUM_WORDS] += s[:sc.PARTIAL_SUM_WORDS]
            c32, s32 = combined.view(np.int32), s.view(np.int32)
            pair = slice(sc.PARTIAL_MAX_INT32, sc.PARTIAL_MAX_INT32 + 2)
            c32[pair] = np.maximum(c32[pair], s32[pair])
        got = stepcore.finalize(sc.partial_words(combined))
        whole = stepcore.finalize(e.norm_partial([np.concatenate(shards)], exact=exact))
        assert got == whole
        assert got[1] and not got[3]


def test_result_values_read_a_norm_result():
    raw = np.zeros(RESULT, np.uint8)
    raw[0:4] = np.frombuffer(np.float32(2.5).tobytes(), np.uint8)
    raw[4:8] = np.frombuffer(np.float32(1.25).tobytes(), np.uint8)
    raw[8] = 1  # finite
    assert sc.result_values(raw) == (2.5, True, 1.25, False)
    assert sc.read_result(raw.view(np.int64)) == (2.5, True, 1.25, False)
    with pytest.raises(ValueError, match="'result'"):
        sc.result_values(raw[:8])


# ---- on a GPU: every launcher against the CPU engine, bit for bit -------------------------

SIZES = [0, 1, 33, 1025, 65537]


@pytest.fixture
def cuda_torch():
    torch = pytest.importorskip("torch")
    if not sc.built_with_cuda():
        pytest.skip("stepcore was built without CUDA (STEPCORE_CUDA=OFF)")
    if not torch.cuda.is_available():
        pytest.skip(f"torch.cuda is unavailable (torch {torch.__version__}, CUDA "
                    f"{torch.version.cuda}): no CUDA build of torch, driver or GPU")
    if sc.device_count() == 0:
        pytest.skip("stepcore sees no CUDA device: " + sc.unavailable_reason())
    torch.cuda.set_device(0)
    return torch


def bits(t):
    """The bit patterns of a tensor (int32 for float32, int16 for 16-bit floats), as bytes."""
    import torch
    t = t.detach().cpu().contiguous().reshape(-1)
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.view(as_int[t.dtype]).numpy().tobytes()


def assert_same_bits(cpu, dev, what):
    for i, (a, b) in enumerate(zip(cpu, dev)):
        assert a.dtype == b.dtype
        assert bits(a) == bits(b), f"{what}[{i}] (numel {a.numel()}) differs"


def randn(torch, gen, n, dtype, scale=1.0):
    return (torch.randn(n, generator=gen, dtype=torch.float32) * scale).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("formula", ["torch", "native"])
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_adamw_optimizer_step_equals_the_cpu_engine(cuda_torch, grad_dtype, formula):
    torch = cuda_torch
    gd = getattr(torch, grad_dtype)
    gen = torch.Generator().manual_seed(11)
    e = stepcore.Engine(threads=2)
    hyper = dict(HYPER, formula=formula)
    params = [randn(torch, gen, n, torch.float32) for n in SIZES]
    moments = [torch.zeros(n) for n in SIZES]
    squares = [torch.zeros(n) for n in SIZES]
    steps = [torch.zeros(()) for _ in SIZES]
    computes = [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES]
    cpu = [params, moments, squares, steps, computes]
    dev = [[t.cuda() for t in ts] for ts in cpu]
    d_scale = torch.tensor([0.5], device="cuda")
    d_clip = torch.tensor([0.75], device="cuda")
    table = torch.from_numpy(sc.make_optimizer_table("adamw", hyper)).cuda()
    d_hyper = torch.tensor([hyper["lr"], hyper["weight_decay"]], dtype=torch.float64, device="cuda")
    found = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    for step in range(4):
        grads = [randn(torch, gen, n, gd, scale=3.0) for n in SIZES]
        e.step("adamw", params, [moments, squares], steps, grads, computes, hyper=hyper,
               grad_scale=0.5, clip=0.75)
        d_grads = [g.cuda() for g in grads]
        stream.wait_stream(torch.cuda.current_stream())
        # The stream as the object (__cuda_stream__) and as its int; lr and weight decay from
        # the device (step_hyper) on odd steps, from the dict on even ones.
        sc.optimizer_step("adamw", dev[0], dev[1:3], dev[3], d_grads, dev[4], hyper=hyper,
                          scale=d_scale, clip=d_clip, table=table, found_inf=found,
                          step_hyper=d_hyper if step % 2 else None,
                          stream=stream if step < 2 else stream.cuda_stream)
        stream.synchronize()
        for name, c, d in zip(("params", "exp_avgs", "exp_avg_sqs", "steps", "computes"), cpu, dev):
            assert_same_bits(c, d, f"step {step}: {name}")
    # found_inf != 0: nothing changes, step counters included.
    found.fill_(1)
    before = [[bits(t) for t in ts] for ts in dev]
    with torch.cuda.stream(stream):  # stream=None: the current stream
        sc.optimizer_step("adamw", dev[0], dev[1:3], dev[3], [g.cuda() for g in grads], dev[4],
                          hyper=hyper, scale=d_scale, clip=d_clip, table=table, found_inf=found)
    stream.synchronize()
    assert [[bits(t) for t in ts] for ts in dev] == before


def norm_of(e, torch, tensors, grad_scale=1.0, clip=1.0):
    """(norm, finite, max_abs) of the CPU engine, with its exact fallback."""
    norm, finite, max_abs, needs_exact = stepcore.finalize(
        e.norm_partial(tensors, grad_scale=grad_scale, clip=clip))
    if needs_exact:
        norm, finite, max_abs, needs_exact = stepcore.finalize(
            e.norm_partial(tensors, grad_scale=grad_scale, clip=clip, exact=True))
    return norm, finite, max_abs


def f32_bits(x):
    return np.float32(x).tobytes()


class NormBuffers:
    def __init__(self, torch, tensors):
        dev = dict(dtype=torch.uint8, device="cuda")
        self.workspace = torch.empty(max(1, sc.scale_and_norm_workspace_bytes(tensors)), **dev)
        self.partial = torch.empty(PARTIAL, **dev)
        self.exact = torch.empty(PARTIAL, **dev)
        self.result = torch.empty(RESULT, **dev)
        self.clip = torch.full((1,), -1.0, device="cuda")
        self.found = torch.full((1,), -1, dtype=torch.int32, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_scale_and_norm_partial_and_finalize_equal_the_cpu_engine(cuda_torch, grad_dtype):
    torch = cuda_torch
    gd = getattr(torch, grad_dtype)
    gen = torch.Generator().manual_seed(12)
    e = stepcore.Engine(threads=2)
    exps = [0, -20, 5, 0, 3]
    cpu = [randn(torch, gen, n, gd, scale=10.0 ** k) for n, k in zip(SIZES, exps)]
    dev = [t.cuda() for t in cpu]
    b = NormBuffers(torch, dev)
    scale, max_norm = 0.37, 1.0
    e.scale_(cpu, scale)
    norm, finite, max_abs = norm_of(e, torch, cpu)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # stream=None: torch's current stream, the side stream
        sc.scale_and_norm_partial(dev, scale, b.partial, b.workspace)
        sc.finalize_and_clip(b.partial, max_norm, b.result, b.clip, b.found)
        sc.exact_norm_partial_if_needed(dev, b.found, b.exact, b.workspace)
        sc.finalize_exact_and_clip(b.exact, max_norm, b.result, b.clip, b.found)
    stream.synchronize()
    assert_same_bits(cpu, dev, "scaled tensors")
    got = sc.read_result(b.result)
    assert f32_bits(got[0]) == f32_bits(norm) and got[1] == finite and got[3] is False
    assert f32_bits(got[2]) == f32_bits(max_abs)
    assert f32_bits(b.clip.item()) == f32_bits(stepcore.clip_coefficient(norm, max_norm))
    assert b.found.item() == sc.FOUND_INF_NONE
    fast = stepcore.finalize(sc.read_partial(b.partial))
    if not fast[3]:
        assert f32_bits(fast[0]) == f32_bits(norm)
    # The read-only norm pass with a gradient read, on the int stream of the side stream.
    grad_scale, clip = 0.5, 0.25
    want = norm_of(e, torch, cpu, grad_scale, clip)
    sc.norm_partial(dev, b.partial, b.workspace, grad_scale=grad_scale, clip=clip,
                    stream=stream.cuda_stream)
    sc.finalize_and_clip(b.partial, max_norm, b.result, b.clip, b.found, stream=stream)
    stream.synchronize()
    if b.found.item() == sc.FOUND_INF_NONE:  # else (~1 in 65,536) the exact pass below decides
        got = sc.read_result(b.result)
        assert f32_bits(got[0]) == f32_bits(want[0]) and f32_bits(got[2]) == f32_bits(want[2])
    assert_same_bits(cpu, dev, "tensors after norm_partial (read only)")
    # The exact pass, forced: the reference partial digit for digit.
    b.found.fill_(sc.FOUND_INF_NEEDS_EXACT)  # on the current stream, before the side one
    stream.wait_stream(torch.cuda.current_stream())
    sc.exact_norm_partial_if_needed(dev, b.found, b.exact, b.workspace, grad_scale=grad_scale,
                                    clip=clip, stream=stream)
    sc.finalize_exact_and_clip(b.exact, max_norm, b.result, b.clip, b.found, stream=stream)
    stream.synchronize()
    exact_words = e.norm_partial(cpu, grad_scale=grad_scale, clip=clip, exact=True)
    assert np.array_equal(sc.read_partial(b.exact), exact_words)
    got = sc.read_result(b.result)
    assert f32_bits(got[0]) == f32_bits(want[0]) and b.found.item() == sc.FOUND_INF_NONE


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_a_captured_norm_pass_reads_scale_and_clip_at_each_replay(cuda_torch, grad_dtype):
    """The three norm passes captured once in a CUDA graph with the scale and clip in
    device memory, replayed with a different scale and clip each time: the bits of eager
    launches with those values as numbers (tensors, partials, exact partials)."""
    torch = cuda_torch
    gd = getattr(torch, grad_dtype)
    gen = torch.Generator().manual_seed(14)
    src = [randn(torch, gen, n, gd, scale=3.0).cuda() for n in SIZES]
    dev = [t.clone() for t in src]
    b = NormBuffers(torch, dev)
    read_partial = torch.empty(PARTIAL, dtype=torch.uint8, device="cuda")
    b.found.fill_(sc.FOUND_INF_NEEDS_EXACT)  # read only: the exact pass always runs
    d_scale = torch.ones(1, device="cuda")
    d_clip = torch.ones(1, device="cuda")

    def passes(tensors, buffers, scale, clip, read):
        sc.scale_and_norm_partial(tensors, scale, buffers.partial, buffers.workspace)
        sc.norm_partial(tensors, read, buffers.workspace, grad_scale=scale, clip=clip)
        sc.exact_norm_partial_if_needed(tensors, buffers.found, buffers.exact, buffers.workspace,
                                        grad_scale=scale, clip=clip)

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # stream None: the capture stream, torch's current one
        passes(dev, b, d_scale, d_clip, read_partial)
    for scale, clip in ((0.5, 1.0), (0.25, 0.75), (3.0, 0.5)):
        for t, s in zip(dev, src):
            t.copy_(s)
        d_scale.fill_(scale)
        d_clip.fill_(clip)
        graph.replay()
        eager = [s.clone() for s in src]
        e = NormBuffers(torch, eager)
        e.found.fill_(sc.FOUND_INF_NEEDS_EXACT)
        e_read = torch.empty(PARTIAL, dtype=torch.uint8, device="cuda")
        passes(eager, e, scale, clip, e_read)
        torch.cuda.synchronize()
        what = f"scale {scale}, clip {clip}"
        assert_same_bits(eager, dev, f"{what}: scaled tensors")
        for name, got, want in (("partial", b.partial, e.partial), ("read", read_partial, e_read),
                                ("exact", b.exact, e.exact)):
            assert np.array_equal(sc.read_partial(got), sc.read_partial(want)), f"{what}: {name}"


@pytest.mark.gpu
def test_device_partials_combine_across_ranks_as_documented(cuda_torch):
    """Two "ranks" on one GPU: SUM int64 words [0, PARTIAL_SUM_WORDS), MAX the int32 pair at
    PARTIAL_MAX_INT32 (what torch.distributed.all_reduce would do), then finalize_and_clip."""
    torch = cuda_torch
    gen = torch.Generator().manual_seed(13)
    e = stepcore.Engine(threads=2)
    shards = [[randn(torch, gen, n, torch.float32, scale=s)] for n, s in ((70000, 1e-3), (0, 1.0),
                                                                         (33, 1e4))]
    want = norm_of(e, torch, [t for s in shards for t in s])
    partials = []
    for s in shards:
        dev = [t.cuda() for t in s]
        b = NormBuffers(torch, dev)
        sc.scale_and_norm_partial(dev, 1.0, b.partial, b.workspace)
        partials.append(b.partial)
    combined = partials[0].view(torch.int64).clone()
    pair = slice(sc.PARTIAL_MAX_INT32, sc.PARTIAL_MAX_INT32 + 2)
    for p in partials[1:]:
        combined[:sc.PARTIAL_SUM_WORDS] += p.view(torch.int64)[:sc.PARTIAL_SUM_WORDS]
        c32 = combined.view(torch.int32)
        c32[pair] = torch.maximum(c32[pair], p.view(torch.int32)[pair])
    b = NormBuffers(torch, [])
    sc.finalize_and_clip(combined, 1.0, b.result, b.clip, b.found)
    sc.exact_norm_partial_if_needed([t.cuda() for s in shards for t in s], b.found, b.exact,
                                    torch.empty(PARTIAL * 4, dtype=torch.uint8, device="cuda"))
    sc.finalize_exact_and_clip(b.exact, 1.0, b.result, b.clip, b.found)
    got = sc.read_result(b.result)  # torch's current stream: the launches' stream
    assert f32_bits(got[0]) == f32_bits(want[0]) and f32_bits(got[2]) == f32_bits(want[2])


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_sign_sgd_optimizer_step_equals_the_cpu_engine(cuda_torch, grad_dtype):
    torch = cuda_torch
    gd = getattr(torch, grad_dtype)
    gen = torch.Generator().manual_seed(14)
    e = stepcore.Engine(threads=2)
    params = [randn(torch, gen, n, torch.float32) for n in SIZES]
    computes = [torch.zeros(n, dtype=torch.float16) for n in SIZES]
    dev_p = [t.cuda() for t in params]
    dev_c = [t.cuda() for t in computes]
    found = torch.zeros(1, dtype=torch.int32, device="cuda")
    for step, (lr, wd) in enumerate([(1e-2, 0.0), (3e-3, 0.1), (1e-3, 0.01)]):
        grads = [randn(torch, gen, n, gd) for n in SIZES]
        e.step("sign_sgd", params, [], None, grads, computes, hyper=dict(lr=lr, weight_decay=wd))
        if step == 2:  # lr and weight decay from device memory, the dict's ignored
            d_hyper = torch.tensor([lr, wd], dtype=torch.float64, device="cuda")
            sc.optimizer_step("sign_sgd", dev_p, [], None, [g.cuda() for g in grads], dev_c,
                              hyper=dict(lr=0.5, weight_decay=0.0), found_inf=found,
                              step_hyper=d_hyper)
        else:
            sc.optimizer_step("sign_sgd", dev_p, [], None, [g.cuda() for g in grads], dev_c,
                              hyper=dict(lr=lr, weight_decay=wd))
        torch.cuda.synchronize()
        assert_same_bits(params, dev_p, f"step {step}: params")
        assert_same_bits(computes, dev_c, f"step {step}: computes")
    found.fill_(1)
    before = [bits(t) for t in dev_p + dev_c]
    sc.optimizer_step("sign_sgd", dev_p, [], None, [g.cuda() for g in grads], dev_c,
                      hyper=dict(lr=1e-2), found_inf=found)
    torch.cuda.synchronize()
    assert [bits(t) for t in dev_p + dev_c] == before


@pytest.mark.gpu
@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16", "float16"])
def test_accumulate_and_scale_equal_the_cpu_engine(cuda_torch, src_dtype):
    torch = cuda_torch
    sd = getattr(torch, src_dtype)
    gen = torch.Generator().manual_seed(15)
    e = stepcore.Engine(threads=2)
    accs = [randn(torch, gen, n, torch.float32) for n in SIZES]
    dev = [t.cuda() for t in accs]
    for copy in (False, True, False):
        srcs = [randn(torch, gen, n, sd) for n in SIZES]
        e.accumulate(accs, srcs, copy=copy)
        sc.accumulate(dev, [s.cuda() for s in srcs], copy=copy)
        torch.cuda.synchronize()
        assert_same_bits(accs, dev, f"accs (copy={copy})")
    e.scale_(accs, 0.3)
    sc.scale_(dev, torch.tensor(0.3, device="cuda"))
    torch.cuda.synchronize()
    assert_same_bits(accs, dev, "scaled accs")


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["object", "int", "current"])
def test_launches_are_ordered_on_the_given_stream(cuda_torch, how):
    """The launch runs on the stream named (after a long kernel and a fill queued there), not
    on the legacy default stream, which torch's side streams do not wait for."""
    torch = cuda_torch
    n = 1 << 20
    acc = torch.zeros(n, device="cuda")
    src = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds
        src.fill_(2.0)
    if how == "current":
        with torch.cuda.stream(stream):
            sc.accumulate([acc], [src])
    else:
        sc.accumulate([acc], [src], stream=stream if how == "object" else stream.cuda_stream)
    stream.synchronize()
    assert bool((acc == 2.0).all())


class Described(FakeCuda):
    """`n` float32 values at device address `address`, described to DLPack as CUDA memory of
    `device_id` (which need not be where the memory is)."""

    def __init__(self, address, n, device_id):
        super().__init__(np.zeros(n, np.float32), device_id)
        self.address = address

    def __dlpack__(self, **kwargs):
        capsule = super().__dlpack__(**kwargs)
        self._keep[-1][0].dl_tensor.data = self.address
        return capsule


@pytest.mark.gpu
def test_a_launch_runs_on_its_arrays_device_and_refuses_another_devices_memory(cuda_torch):
    """Arrays on cuda:1 while cuda:0 is current: the launch runs on cuda:1 (the CPU engine's
    bits) and cuda:0 is current again after. An array that claims cuda:1 but whose memory is
    on cuda:0 is refused naming it, before anything is written."""
    torch = cuda_torch
    if sc.device_count() < 2:
        pytest.skip(f"needs two CUDA devices (the launch's and another); "
                    f"{sc.device_count()} present")
    gen = torch.Generator().manual_seed(17)
    acc_cpu = randn(torch, gen, 1025, torch.float32)
    src_cpu = randn(torch, gen, 1025, torch.bfloat16)
    want = acc_cpu.clone()
    stepcore.Engine(threads=1).accumulate([want], [src_cpu])
    torch.cuda.set_device(0)
    acc = acc_cpu.to("cuda:1")
    src = src_cpu.to("cuda:1")
    sc.accumulate([acc], [src])
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert bits(acc) == bits(want)
    on0 = torch.zeros(1025, device="cuda:0")
    before = bits(acc)
    with pytest.raises(ValueError, match=r"'srcs\[0\]': device memory of CUDA device 0, but "
                                         r"the launch runs on device 1"):
        sc.accumulate([acc], [Described(on0.data_ptr(), 1025, 1)])
    torch.cuda.synchronize(1)
    assert bits(acc) == before
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
def test_an_array_on_a_device_that_is_not_present_is_refused_naming_it(cuda_torch):
    torch = cuda_torch
    n = sc.device_count()
    acc = torch.zeros(4, device="cuda:0")
    with pytest.raises(ValueError, match=rf"'accs\[0\]': is on CUDA device {n}, but {n} devices"):
        sc.accumulate([Described(acc.data_ptr(), 4, n)], [acc],
                      stream=torch.cuda.current_stream().cuda_stream)


@pytest.mark.gpu
def test_nccl_drives_the_device_memory_communicator_to_one_process_bits(cuda_torch):
    """stepcore.torch.GradientManager on CUDA parameters over an NCCL group, each rank a
    slice of every parameter (test_torch_manager's gloo workers on cuda:rank): modes none
    and optimizer all-reduce the norm words in CUDA memory on the compute stream (the device
    callback communicator), mode full in host memory staged through the GPU (NCCL has no
    CPU backend); every mode gives one process's bits, and a "cpu:gloo" group is refused
    for CUDA memory naming 'process_group'. Two GPUs: two processes; one GPU: one NCCL rank
    whose manager is told of two, so that it builds and drives the communicator."""
    torch = cuda_torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip(f"torch {torch.__version__} has no NCCL backend")
    import test_torch_manager as tm

    world = min(2, torch.cuda.device_count())
    results = tm.run_sliced_processes(world, "nccl", world_size=None if world > 1 else 2)
    tm.check_sliced_results(results, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("formula", ["torch", "torchao"])
def test_eight_bit_slots_on_the_device_equal_the_cpu_engine(cuda_torch, formula):
    """optimizer_step with (codes, absmax) pairs on the device and q8_codebooks(): every
    param, code and block maximum of Engine.step's, four steps, boundary sizes."""
    torch = cuda_torch
    gen = torch.Generator().manual_seed(5)
    e = stepcore.Engine(threads=2)
    hyper = dict(HYPER, formula=formula)
    sizes = [1, 255, 257, 4097, 70001]
    blocks = [(n + 255) // 256 for n in sizes]
    params = [randn(torch, gen, n, torch.float32) for n in sizes]
    slots = [[(torch.zeros(n, dtype=torch.uint8), torch.zeros(b)) for n, b in zip(sizes, blocks)]
             for _ in range(2)]
    steps = [torch.zeros(()) for _ in sizes]
    dev_params = [p.cuda() for p in params]
    dev_slots = [[(c.cuda(), a.cuda()) for c, a in s] for s in slots]
    dev_steps = [s.cuda() for s in steps]
    d_scale = torch.tensor([0.5], device="cuda")
    d_clip = torch.tensor([0.75], device="cuda")
    table = torch.from_numpy(sc.make_optimizer_table("adamw", hyper)).cuda()
    books = torch.from_numpy(sc.q8_codebooks()).cuda()
    for step in range(4):
        grads = [randn(torch, gen, n, torch.float32, scale=3.0) for n in sizes]
        e.step("adamw", params, slots, steps, grads, hyper=hyper, grad_scale=0.5, clip=0.75)
        sc.optimizer_step("adamw", dev_params, dev_slots, dev_steps, [g.cuda() for g in grads],
                          hyper=hyper, scale=d_scale, clip=d_clip, table=table,
                          q8_codebooks=books)
        torch.cuda.synchronize()
        assert_same_bits(params, dev_params, f"step {step}: params")
        for k in range(2):
            for i, ((c, _), (d, _)) in enumerate(zip(slots[k], dev_slots[k])):
                assert torch.equal(c, d.cpu()), f"step {step}: codes of slot {k}, tensor {i}"
            assert_same_bits([a for _, a in slots[k]], [a for _, a in dev_slots[k]],
                             f"step {step}: maxima of slot {k}")
    with pytest.raises(ValueError, match="q8_codebooks"):
        sc.optimizer_step("adamw", dev_params, dev_slots, dev_steps, [g.cuda() for g in grads],
                          hyper=hyper, scale=d_scale, clip=d_clip, table=table)
