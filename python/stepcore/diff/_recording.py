"""Recordings: a directory of one safetensors file per (step, rank) and a manifest.json.

`Recorder` copies tensors (torch tensors, DTensors' local shards with their placement,
numpy arrays) to CPU bytes when they are recorded and writes each step's file when the
step ends (temp file, fsync, rename). manifest.json (format, version 2, run metadata, the
journal's name) is replaced atomically the same way, only when the run metadata changes;
the entries go to the journal entries.jsonl, a line each, appended and fsync'd after each
step's files: a step costs what it records, not the whole run so far. A crash leaves the
steps completed; an append it tore (a last line without its newline) is ignored by the
readers. `read_recording` checks a recording (version 1's inline entries too) and raises
FormatError naming the file and the problem. Importing this module never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys

import numpy as np

from ._safetensors import DTYPES, FormatError, _no_duplicate_keys, read_file, write_file

__all__ = ["FORMAT", "VERSION", "Recorder", "Recording", "read_recording"]

FORMAT = "stepcore-recording"
VERSION = 2  # 1: the entries inline in manifest.json (still read)
MANIFEST = "manifest.json"
JOURNAL = "entries.jsonl"
_FILE_RE = re.compile(r"^step\d{6,}-rank\d+\.safetensors(\.tmp)?$")
_FACTS = ("stepcore_version", "isa", "torch_version")  # run metadata the user cannot set
_ENTRY_FIELDS = ("step", "point", "name", "rank", "file", "key", "dtype", "shape")
_PLACEMENT_FIELDS = ("global_shape", "global_offset")  # a shard's place in the whole

_TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64",
                 "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
                 "uint8": "U8", "bool": "BOOL"}


def file_name(step: int, rank: int) -> str:
    """Returns the file name of (step, rank): step%06d-rank%d.safetensors."""
    return f"step{step:06d}-rank{rank}.safetensors"


def _torch_module():
    """Returns torch when the process has imported it (never imports it), else None."""
    return sys.modules.get("torch")


def _dist_rank_world():
    """Returns (rank, world size) of torch.distributed when initialised, else None."""
    torch = _torch_module()
    if torch is None:
        return None
    try:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover - a torch without distributed
        return None
    return None


def _numpy_bytes(a: np.ndarray, what: str):
    """Returns (dtype name, shape, little-endian bytes) of a numpy array (a copy)."""
    dt = a.dtype
    if dt.kind == "b":
        name = "BOOL"
    elif dt.kind == "f" and dt.itemsize in (2, 4, 8):
        name = {2: "F16", 4: "F32", 8: "F64"}[dt.itemsize]
    elif dt.kind == "i" and dt.itemsize in (1, 2, 4, 8):
        name = {1: "I8", 2: "I16", 4: "I32", 8: "I64"}[dt.itemsize]
    elif dt.kind == "u" and dt.itemsize == 1:
        name = "U8"
    else:
        raise TypeError(f"stepcore.diff: {what} has dtype {dt}, which a recording cannot hold "
                        "(F32, BF16, F16, F64, I64, I32, I16, I8, U8, BOOL)")
    le = np.ascontiguousarray(a, dtype=dt.newbyteorder("<"))
    return name, tuple(int(d) for d in a.shape), le.tobytes()


def _dtensor_placement(t):
    """Returns (global shape, global offset) of a DTensor's local shard, or None when the
    local shard is the whole tensor (replicated)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch before 2.5 kept DTensor in torch.distributed._tensor
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset

    global_shape = tuple(int(d) for d in t.shape)
    local, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(int(d) for d in local) == global_shape:
        return None
    return list(global_shape), [int(o) for o in offset]


def _tensor_bytes(tensor, what: str):
    """Returns (dtype name, local shape, bytes, placement or None) of a torch tensor,
    DTensor or numpy array; placement: a DTensor shard's (global shape, global offset)."""
    if isinstance(tensor, (np.ndarray, np.generic)):
        return _numpy_bytes(np.asarray(tensor), what) + (None,)
    torch = _torch_module()
    if torch is not None and isinstance(tensor, torch.Tensor):
        t = tensor.detach()
        placement = None
        if hasattr(t, "to_local") and type(t).__name__ == "DTensor":
            placement = _dtensor_placement(t)
            t = t.to_local().detach()  # this rank's shard
        name = _TORCH_DTYPES.get(str(t.dtype).replace("torch.", ""))
        if name is None:
            raise TypeError(f"stepcore.diff: {what} has dtype {t.dtype}, which a recording "
                            "cannot hold (F32, BF16, F16, F64, I64, I32, I16, I8, U8, BOOL)")
        if t.layout != torch.strided:
            raise TypeError(f"stepcore.diff: {what} has layout {t.layout}; only dense tensors "
                            "can be recorded")
        shape = tuple(int(d) for d in t.shape)
        flat = t.reshape(-1).cpu()
        raw = flat.contiguous().view(torch.uint8).numpy().tobytes()  # a copy at once
        if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
            size = DTYPES[name][0]
            raw = np.frombuffer(raw, f">u{size}" if size > 1 else "u1").astype(
                f"<u{size}" if size > 1 else "u1").tobytes()
        return name, shape, raw, placement
    raise TypeError(f"stepcore.diff: {what} must be a torch tensor or a numpy array, got "
                    f"{type(tensor).__name__}")


def _check_placement(shape, global_shape, global_offset):
    """Returns ([global shape], [global offset]) given to record(); raises ValueError naming
    the argument when they are not lists of non-negative integers of the shard's rank that
    hold the shard inside the whole."""
    out = []
    for arg, v in (("global_shape", global_shape), ("global_offset", global_offset)):
        if not isinstance(v, (list, tuple)) or len(v) != len(shape) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
            raise ValueError(f"stepcore.diff: '{arg}' must be a list of {len(shape)} "
                             f"non-negative integers (the shard's shape is {list(shape)}), "
                             f"got {v!r}")
        out.append([int(x) for x in v])
    if any(o + n > g for n, g, o in zip(shape, out[0], out[1])):
        raise ValueError(f"stepcore.diff: 'global_offset' {out[1]} puts the shard of shape "
                         f"{list(shape)} outside 'global_shape' {out[0]}")
    return out[0], out[1]


def _manifest_text(run: dict) -> str:
    """Returns manifest.json's text (version 2: the entries are in the journal)."""
    return json.dumps({"format": FORMAT, "version": VERSION, "run": run,
                       "journal": JOURNAL}) + "\n"


def _append_lines(path: str, lines) -> int:
    """Appends the lines (each ended by a newline) to `path` in one write, fsync'd; returns
    the bytes written."""
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(data)


def _write_text_atomically(path: str, text: str) -> None:
    """Writes `text` to path + '.tmp', flushes it to disk and renames it over path."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _base_run_metadata() -> dict:
    """Returns the run metadata every recording carries (versions, the CPU engine, torch)."""
    from .. import _core

    engine = _core.Engine()
    run = {"stepcore_version": _core.__version__, "isa": engine.isa,
           "threads": int(engine.threads), "device": "cpu", "offload": None, "formula": None}
    torch = _torch_module()
    if torch is not None:
        run["torch_version"] = str(torch.__version__)
    return run


# Recorder: steps are numbered from 1. `record(point, name, tensor)` adds a tensor to the
# current step (`rec.step`); `next_step()` writes the step's file and moves to the next;
# `begin_step(s)` ends the current step and starts step `s` (greater than every step
# begun before); `with rec.step_scope(s):` begins step `s` and ends it on exit. A
# `stepcore.torch.GradientManager(..., recorder=rec)` records its state after each
# `step()` and then ends the step itself (outside a step_scope).
#
# `rank=None`: under torch.distributed (initialised, several ranks) every rank records
# into the same directory, writing its own files, and rank 0 writes the manifest with
# every rank's entries, gathered when a step ends (ending a step, begin_step, flush and
# close are then collective calls every rank makes); without it the rank is 0. An
# explicit `rank` records this process alone with its own manifest (give each such
# process its own directory).


class Recorder:
    """Records named tensors per step into a recording directory (see docs/python.md)."""

    def __init__(self, directory, run_metadata=None, *, rank=None, overwrite=False):
        """Checks the arguments (naming a bad one), then creates or empties the directory."""
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"stepcore.diff: 'directory' must be a path, got "
                            f"{type(directory).__name__}")
        self.directory = os.fspath(directory)
        dist = _dist_rank_world() if rank is None else None
        if rank is None:
            rank = dist[0] if dist else 0
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"stepcore.diff: 'rank' must be a non-negative integer or None, "
                             f"got {rank!r}")
        self.rank = rank
        self._world = dist[1] if dist else 1
        if run_metadata is not None and not isinstance(run_metadata, dict):
            raise TypeError("stepcore.diff: 'run_metadata' must be a dict or None, got "
                            f"{type(run_metadata).__name__}")
        run = _base_run_metadata()
        for k, v in (run_metadata or {}).items():
            if not isinstance(k, str):
                raise TypeError(f"stepcore.diff: 'run_metadata' key {k!r} is not a string")
            if k in _FACTS:
                raise ValueError(f"stepcore.diff: 'run_metadata' must not set {k!r} (the "
                                 "recorder records it)")
            try:
                json.dumps(v)
            except (TypeError, ValueError):
                raise TypeError(f"stepcore.diff: 'run_metadata'[{k!r}] is not JSON "
                                f"serializable ({type(v).__name__})") from None
            run[k] = v
        self._run = run
        self._prepare_directory(bool(overwrite))
        self._step = 1
        self._last_begun = 0    # begin_step must go past this
        self._pending = []      # (entry, bytes) of the current step
        self._keys = set()      # (point, name) of the current step
        self._dirty = False     # the current step has tensors not yet in its file
        self._scoped = False
        self._closed = False
        if self.rank == 0:  # an empty journal, then the manifest that names it
            _append_lines(os.path.join(self.directory, JOURNAL), [])
        self._write_manifest()

    # ---- the directory ---------------------------------------------------------------

    def _prepare_directory(self, overwrite: bool) -> None:
        """Checks (rank 0: creates or empties) the directory; every rank learns the outcome."""
        error = None
        if self.rank == 0:
            error = self._check_directory(overwrite)
        if self._world > 1:
            import torch.distributed as dist  # a process with torch.distributed running

            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise ValueError(error)

    def _check_directory(self, overwrite: bool):
        """Creates or (overwrite) empties the recording's directory; returns an error or None."""
        d = self.directory
        if os.path.exists(d) and not os.path.isdir(d):
            return f"stepcore.diff: 'directory' {d} exists and is not a directory"
        if os.path.isdir(d):
            names = os.listdir(d)
            if names and not overwrite:
                return (f"stepcore.diff: 'directory' {d} exists and is not empty (pass "
                        "overwrite=True to replace a recording there)")
            if names:
                others = [n for n in names if n not in (MANIFEST, MANIFEST + ".tmp", JOURNAL)
                          and not _FILE_RE.match(n)]
                if others:
                    return (f"stepcore.diff: 'directory' {d} holds files that are not a "
                            f"recording's ({', '.join(sorted(others)[:3])}); not overwriting")
                for n in names:
                    os.remove(os.path.join(d, n))
            return None
        try:
            os.makedirs(d)
        except OSError as e:
            return f"stepcore.diff: 'directory' {d} cannot be created ({e.strerror or e})"
        return None

    # ---- steps -----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step being recorded (from 1)."""
        return self._step

    @property
    def run(self) -> dict:
        """The run metadata written to the manifest (a copy)."""
        return dict(self._run)

    def _check_open(self) -> None:
        """Raises RuntimeError when the recorder was closed."""
        if self._closed:
            raise RuntimeError(f"stepcore.diff: the recorder of {self.directory} is closed")

    def record(self, point, name, tensor, *, global_shape=None, global_offset=None) -> None:
        """Copies `tensor` (its local shard for a DTensor) into the current step as point/name.

        A DTensor's shard is recorded with its placement (global shape and offset) when it
        is not the whole tensor; for another tensor that is a shard of a larger one, give
        `global_shape` and `global_offset` (its first element's coordinates in the whole).
        The comparer gathers the shards of a (step, point, name) into the whole tensor.
        """
        self._check_open()
        if not isinstance(point, str) or not point or "/" in point:
            raise ValueError(f"stepcore.diff: 'point' must be a non-empty string without '/', "
                             f"got {point!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"stepcore.diff: 'name' must be a non-empty string, got {name!r}")
        if (point, name) in self._keys:
            raise ValueError(f"stepcore.diff: duplicate entry (step {self._step}, rank "
                             f"{self.rank}, point {point!r}, name {name!r})")
        dtype, shape, raw, placement = _tensor_bytes(tensor, f"'tensor' ({point}/{name})")
        if global_shape is not None or global_offset is not None:
            placement = _check_placement(shape, global_shape, global_offset)
        entry = {"step": self._step, "point": point, "name": name, "rank": self.rank,
                 "file": file_name(self._step, self.rank), "key": f"{point}/{name}",
                 "dtype": dtype, "shape": list(shape)}
        if placement is not None:
            entry["global_shape"], entry["global_offset"] = placement
        self._keys.add((point, name))
        self._pending.append((entry, raw))
        self._dirty = True
        if self._last_begun < self._step:
            self._last_begun = self._step

    def flush(self) -> None:
        """Writes the current step's file (all its tensors so far) and the manifest."""
        self._check_open()
        self._flush()

    def _flush(self) -> None:
        """Writes the step's file when it has new tensors, then gathers and writes the manifest."""
        mine = []
        if self._dirty:
            write_file(os.path.join(self.directory, file_name(self._step, self.rank)),
                       [(e["key"], e["dtype"], e["shape"], raw) for e, raw in self._pending],
                       {"step": str(self._step), "rank": str(self.rank)})
            mine = [e for e, _ in self._pending if not e.get("_written")]
            for e, _ in self._pending:
                e["_written"] = True
            self._dirty = False
        if self._world > 1:
            import torch.distributed as dist

            gathered = [None] * self._world if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            if self.rank == 0:
                mine = [e for part in gathered for e in part]
        if mine and self.rank == 0:
            if self._world > 1:
                mine = sorted(mine, key=lambda e: (e["step"], e["rank"]))
            _append_lines(os.path.join(self.directory, JOURNAL),
                          [json.dumps({k: e[k] for k in _ENTRY_FIELDS + _PLACEMENT_FIELDS
                                       if k in e}) for e in mine])

    def _write_manifest(self) -> None:
        """Replaces manifest.json atomically (rank 0 only): format, version, run, journal."""
        if self.rank != 0:
            return
        _write_text_atomically(os.path.join(self.directory, MANIFEST), _manifest_text(self._run))

    def next_step(self) -> None:
        """Ends the current step (writes its file and the manifest) and moves to the next."""
        self._check_open()
        self._end_step()
        self._step += 1

    def _end_step(self) -> None:
        """Flushes the current step and forgets its tensors."""
        self._flush()
        self._pending = []
        self._keys = set()

    def begin_step(self, step) -> None:
        """Ends the current step and starts `step` (an integer past every step begun)."""
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"stepcore.diff: 'step' must be an integer >= 1, got {step!r}")
        self._end_step()  # (under torch.distributed a collective: every rank calls it)
        if step <= self._last_begun:
            raise ValueError(f"stepcore.diff: 'step' {step} was already recorded (steps must "
                             f"increase; the last was {self._last_begun})")
        self._step = step
        self._last_begun = step

    @contextlib.contextmanager
    def step_scope(self, step):
        """Context manager: begin_step(step), then the step ends (is written) on exit."""
        self.begin_step(step)
        self._scoped = True
        try:
            yield self
        finally:
            self._scoped = False
            if not self._closed:
                self.next_step()

    def _manager_step_done(self) -> None:
        """Called by a hooked GradientManager after recording its step: ends the step."""
        if not self._scoped:
            self.next_step()

    def _set_run(self, **facts) -> None:
        """Sets run metadata a hooked manager knows (device, offload, formula, threads)."""
        self._check_open()
        changed = False
        for k, v in facts.items():
            if self._run.get(k) != v:
                self._run[k] = v
                changed = True
        if changed:
            self._write_manifest()

    def close(self) -> None:
        """Writes what is pending and closes the recorder (closing twice does nothing)."""
        if self._closed:
            return
        self._end_step()
        self._closed = True

    def __enter__(self):
        """Returns the recorder; it is closed when the block ends."""
        return self

    def __exit__(self, *exc):
        """Closes the recorder."""
        self.close()
        return False


# ---- reading ------------------------------------------------------------------------


class Recording:
    """A checked recording: run metadata, entries in recording order, and their files."""

    def __init__(self, directory, run, entries, files):
        """Stores what read_recording checked."""
        self.directory = directory
        self.run = run
        self.entries = entries  # dicts with the manifest's fields, in recording order
        self._files = files     # file name -> SafetensorsFile

    def file_of(self, entry):
        """Returns the SafetensorsFile that holds `entry`."""
        return self._files[entry["file"]]

    def array(self, entry) -> np.ndarray:
        """Returns `entry`'s tensor (BF16 as uint16 bit patterns), read from its file."""
        return self.file_of(entry).array(entry["key"])

    def get(self, step, point, name, rank=0) -> np.ndarray:
        """Returns the tensor recorded at (step, rank, point, name); KeyError when absent."""
        for e in self.entries:
            if (e["step"], e["rank"], e["point"], e["name"]) == (step, rank, point, name):
                return self.array(e)
        raise KeyError(f"no entry (step {step}, rank {rank}, point {point!r}, name {name!r})")


def read_recording(directory) -> Recording:
    """Reads and checks a recording directory; raises FormatError naming what is wrong."""
    d = os.fspath(directory)
    path = os.path.join(d, MANIFEST)
    if not os.path.isdir(d):
        raise FormatError(f"{d}: not a directory")
    if not os.path.isfile(path):
        raise FormatError(f"{path}: missing (not a recording)")
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise FormatError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        m = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(path))
    except FormatError:
        raise
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(m, dict):
        raise FormatError(f"{path}: the manifest is a JSON {type(m).__name__}, not an object")
    if m.get("format") != FORMAT:
        raise FormatError(f"{path}: format is {m.get('format')!r}, not {FORMAT!r}")
    if m.get("version") not in (1, VERSION) or isinstance(m.get("version"), bool):
        raise FormatError(f"{path}: version {m.get('version')!r} is not supported "
                          f"(this reader knows versions 1 and {VERSION})")
    run = m.get("run", {})
    if not isinstance(run, dict):
        raise FormatError(f"{path}: 'run' is not an object")
    if m["version"] == 1:
        entries = m.get("entries")
        if not isinstance(entries, list):
            raise FormatError(f"{path}: 'entries' is missing or not a list")
        where = lambda i: f"{path}: entries[{i}]"  # noqa: E731
    else:
        journal = m.get("journal")
        if not isinstance(journal, str) or os.path.basename(journal) != journal or \
                journal in ("", ".", ".."):
            raise FormatError(f"{path}: 'journal' {journal!r} is not a file name in the "
                              "recording")
        path = os.path.join(d, journal)
        entries = read_journal(path)
        where = lambda i: f"{path}: line {i + 1}"  # noqa: E731
    files, seen, out = {}, {}, []
    for i, e in enumerate(entries):
        out.append(_check_entry(where(i), e, d, files, seen))
    return Recording(d, run, out, files)


def read_journal(path) -> list:
    """Returns the entries of a journal, a JSON object per line; a last line without its
    newline is an append in progress and is ignored. FormatError names a bad line."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise FormatError(f"{path}: cannot be read ({e.strerror or e})") from None
    lines = text.split(b"\n")[:-1]  # the part after the last newline is not yet written
    out = []
    for i, line in enumerate(lines):
        what = f"{path}: line {i + 1}"
        try:
            e = json.loads(line.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(what))
        except FormatError:
            raise
        except (UnicodeDecodeError, ValueError) as err:
            raise FormatError(f"{what}: invalid JSON ({err})") from None
        if not isinstance(e, dict):
            raise FormatError(f"{what}: a JSON {type(e).__name__}, not an object")
        out.append(e)
    return out


def _check_entry(what, e, d, files, seen) -> dict:
    """Checks the manifest entry `what` against its file; returns it (FormatError naming
    the problem)."""
    if not isinstance(e, dict):
        raise FormatError(f"{what} is not an object")
    for field in _ENTRY_FIELDS:
        if field not in e:
            raise FormatError(f"{what} has no '{field}'")
    for field in ("step", "rank"):
        v = e[field]
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if field == "step" else 0):
            raise FormatError(f"{what}: bad '{field}' {v!r}")
    for field in ("point", "name", "file", "key", "dtype"):
        if not isinstance(e[field], str) or not e[field]:
            raise FormatError(f"{what}: bad '{field}' {e[field]!r}")
    shape = e["shape"]
    if not isinstance(shape, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
        raise FormatError(f"{what}: bad 'shape' {shape!r}")
    if e["dtype"] not in DTYPES:
        raise FormatError(f"{what}: unknown dtype {e['dtype']!r}")
    ident = (e["step"], e["rank"], e["point"], e["name"])
    if ident in seen:
        raise FormatError(f"{what}: duplicate entry (step {ident[0]}, rank {ident[1]}, point "
                          f"{ident[2]!r}, name {ident[3]!r}), also {seen[ident]}")
    seen[ident] = what
    fname = e["file"]
    if os.path.basename(fname) != fname or fname in (".", ".."):
        raise FormatError(f"{what}: 'file' {fname!r} is not a file name in the recording")
    f = files.get(fname)
    if f is None:
        fpath = os.path.join(d, fname)
        if not os.path.isfile(fpath):
            raise FormatError(f"{fpath}: missing (named by {what})")
        f = files[fname] = read_file(fpath)
    t = f.tensors.get(e["key"])
    if t is None:
        raise FormatError(f"{f.path}: has no tensor {e['key']!r} (named by {what})")
    if t.dtype != e["dtype"] or list(t.shape) != shape:
        raise FormatError(f"{f.path}: tensor {e['key']!r} is {t.dtype} {list(t.shape)}, the "
                          f"manifest says {e['dtype']} {shape} ({what})")
    for field in _PLACEMENT_FIELDS:
        v = e.get(field)
        if v is not None and (not isinstance(v, list) or len(v) != len(shape) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)):
            raise FormatError(f"{what}: bad '{field}' {v!r}")
    return {k: e[k] for k in _ENTRY_FIELDS + _PLACEMENT_FIELDS if k in e}
