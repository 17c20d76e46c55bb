#!/usr/bin/env python3
"""Runs every code snippet of the README and the docs, so what they say stays true.

Every fenced block of the project's Markdown (README.md, CONTRIBUTING.md, docs/*.md and
the READMEs in the tree) is checked by its language:

* ``python``: run in a fresh interpreter (``--python``, with the built package on
  ``--pythonpath``) and must exit 0. A block with ``>>>`` prompts is a doctest: each
  statement's printed output must match what the block shows, so a statement of what is
  accepted or refused (an exception shown with its type) is checked too.
* ``cpp``: compiled (``--cxx``, syntax and types only: -fsyntax-only) against the public
  headers, inside a function body; the public headers are included first. The blocks are
  compiled together as one translation unit (each with its prelude in a namespace of its
  own, so the headers are parsed once); when that fails, each alone, to name the failures.

A snippet that needs names it does not define (a model, a batch stream, a config) names a
prelude in an HTML comment on the line just before its fence:

    <!-- snippet: prelude=tiny_model -->

The preludes are tools/snippets/<name>.py (run before the block, same interpreter) and
tools/snippets/<name>.hpp (declarations in scope of the block). ``<!-- snippet: continues -->``
runs a python block after the file's previous python block, in the same interpreter (for
a walk-through split by prose). Two more directives, for what cannot simply run here:

* ``needs=cuda``: a python block that needs a CUDA device (torch's and stepcore's) runs
  only where there is one; elsewhere it is compiled (syntax only) and counted as skipped.
* ``removed=NAME[,NAME...]``: the block shows an API that was removed (docs/api-changes.md's
  "before"): it must fail, and its errors must name each NAME, so it cannot fail for
  another reason, and the names cannot come back unnoticed.

Blocks of any other language (sh, text, cmake, json) are not run. The blocks run in
parallel (``--jobs``).

A generated region is Markdown a program writes from the library itself (a table of the
optimizers, say), so it cannot drift from the code:

    <!-- generated: optimizer_table -->
    ...
    <!-- end generated -->

Its text must equal what tools/snippets/<name>.py prints (run like a python block);
``--fix`` rewrites the regions instead of failing.

Usage: tools/check-snippets.py [--root DIR] [--python EXE] [--pythonpath DIR]
                               [--cxx EXE] [--include DIR ...] [--jobs N] [--list] [--fix]
Exit status: 0 every snippet ran (or was skipped for want of CUDA), 1 a snippet failed
(each failure printed), 2 usage.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FENCE = re.compile(r"^```(\w*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")
GENERATED = re.compile(r"^<!--\s*generated:\s*(\w+)\s*-->\s*$")
END_GENERATED = re.compile(r"^<!--\s*end generated\s*-->\s*$")


class Snippet:
    """One fenced block: where it is, its language, its text and its directives."""

    def __init__(self, path: Path, line: int, lang: str, text: str, directives: dict):
        self.path, self.line, self.lang, self.text = path, line, lang, text
        self.directives = directives

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def parse_directives(text: str) -> dict:
    """Returns {key: value} of a directive comment's words ("prelude=x continues")."""
    out = {}
    for word in text.split():
        key, _, value = word.partition("=")
        out[key] = value or True
    return out


def snippets_of(path: Path, root: Path) -> list[Snippet]:
    """Returns the fenced blocks of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i + 1
        directives = {}
        if i > 0:
            d = DIRECTIVE.match(lines[i - 1])
            if d:
                directives = parse_directives(d.group(1))
        j = start
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        out.append(Snippet(path.relative_to(root), start, lang, "\n".join(lines[start:j]) + "\n",
                           directives))
        i = j + 1
    return out


def markdown_files(root: Path) -> list[Path]:
    """The project's Markdown: tracked files (git), else every .md outside build/."""
    try:
        names = subprocess.run(["git", "-C", str(root), "ls-files", "*.md"], check=True,
                               capture_output=True, text=True).stdout.split()
        files = [root / n for n in names]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in root.rglob("*.md") if "build" not in p.parts]
    return sorted(p for p in files if p.exists() and "data" not in p.relative_to(root).parts)


def prelude(root: Path, name: str, suffix: str) -> str:
    """The text of prelude `name` (tools/snippets/<name><suffix>)."""
    p = root / "tools" / "snippets" / (name + suffix)
    if not p.exists():
        raise FileNotFoundError(f"prelude '{name}' ({p.relative_to(root)}) does not exist")
    return p.read_text(encoding="utf-8")


# Runs a doctest part in the program's own globals (names carry to later parts).
DOCTEST_HELPER = """
import doctest as _doctest
_failed = 0
def _run_doctest(text):
    global _failed
    test = _doctest.DocTestParser().get_doctest(text, globals(), "snippet", None, 0)
    runner = _doctest.DocTestRunner(
        optionflags=_doctest.ELLIPSIS | _doctest.NORMALIZE_WHITESPACE)
    runner.run(test, clear_globs=False)
    _failed += runner.failures
"""


# Exit status of a block that needs CUDA where there is none (compiled, not run), and
# run_python's answer for it.
SKIPPED = 77
SKIP = "skipped: needs CUDA"

# Runs before a block that needs CUDA: exits SKIPPED after compiling the block's text.
NEEDS_CUDA = """
import sys as _sys
try:
    import torch as _torch, stepcore.gpu as _gpu
    _cuda = _torch.cuda.is_available() and _gpu.built_with_cuda()
except ImportError:
    _cuda = False
if not _cuda:
    compile({text!r}, "snippet", "exec")
    _sys.exit({skipped})
"""


def python_program(root: Path, chain: list[Snippet]) -> str:
    """The program of a python block and the blocks it continues, with their preludes."""
    parts = [DOCTEST_HELPER]
    if any(s.directives.get("needs") == "cuda" for s in chain):
        parts.append(NEEDS_CUDA.format(text="\n".join(s.text for s in chain), skipped=SKIPPED))
    for s in chain:
        name = s.directives.get("prelude")
        if name:
            parts.append(prelude(root, name, ".py"))
        parts.append(f"_run_doctest({s.text!r})" if ">>>" in s.text else s.text)
    parts.append("import sys as _sys\n_sys.exit(1 if _failed else 0)")
    return "\n".join(parts) + "\n"


def run_python(root: Path, chain: list[Snippet], args) -> str:
    """Runs a python block (after the blocks it continues); returns '' or the failure."""
    program = python_program(root, chain)
    env = python_env(args)
    with tempfile.TemporaryDirectory(prefix="stepcore-snippet-") as tmp:
        r = subprocess.run([args.python, "-c", program], cwd=tmp, env=env, capture_output=True,
                           text=True, timeout=600)
    if r.returncode == SKIPPED and chain[-1].directives.get("needs") == "cuda":
        return SKIP
    return expected(chain[-1], r.returncode, r.stdout + r.stderr)


def cpp_header(root: Path) -> str:
    """What every cpp block is compiled after: the public headers, <cstdio>, <vector>."""
    headers = sorted((root / "include" / "stepcore").glob("*.hpp"))
    optional = {"comm_mpi.hpp", "comm_nccl.hpp"}  # need MPI / NCCL headers of their own
    includes = "".join(f'#include "stepcore/{h.name}"\n' for h in headers
                       if h.name not in optional)
    return includes + "#include <cstdio>\n#include <vector>\nusing namespace stepcore;\n"


def cpp_block(root: Path, s: Snippet) -> str:
    """A cpp block as a function `snippet`, after its prelude's declarations."""
    name = s.directives.get("prelude")
    decls = prelude(root, name, ".hpp") if name else ""
    return decls + "\nvoid snippet() {\n" + s.text + "}\n"


def compile_cpp(root: Path, source: str, args) -> subprocess.CompletedProcess:
    """Compiles `source` (syntax and types only) against the public headers."""
    with tempfile.TemporaryDirectory(prefix="stepcore-snippet-") as tmp:
        src = Path(tmp) / "snippet.cpp"
        src.write_text(source, encoding="utf-8")
        cmd = [args.cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Wno-unused-variable",
               "-Wno-unused-but-set-variable", "-I", str(root / "include")]
        for inc in args.include:
            cmd += ["-I", inc]
        return subprocess.run(cmd + [str(src)], capture_output=True, text=True, timeout=600)


def run_cpp(root: Path, s: Snippet, args) -> str:
    """Compiles a cpp block inside a function, after every public header and its prelude."""
    r = compile_cpp(root, cpp_header(root) + cpp_block(root, s), args)
    return expected(s, r.returncode, r.stderr)


def run_cpp_together(root: Path, blocks: list[Snippet], args) -> list[str]:
    """Compiles the cpp blocks that must succeed as one translation unit, each block and its
    prelude in a namespace of its own (no name reaches another block), so the headers are
    parsed once; when that fails, each block alone, so each failure names its own block.
    Returns run_cpp's answer per block."""
    if len(blocks) > 1:
        source = cpp_header(root) + "".join(
            f"namespace snippet_{k} {{\n{cpp_block(root, s)}}}  // namespace snippet_{k}\n"
            for k, s in enumerate(blocks))
        if compile_cpp(root, source, args).returncode == 0:
            return [""] * len(blocks)
    return [run_cpp(root, s, args) for s in blocks]


def expected(s: Snippet, returncode: int, output: str) -> str:
    """'' when the block did what it should: succeed, or (removed=...) fail naming each name."""
    removed = s.directives.get("removed")
    if not removed:
        return "" if returncode == 0 else output.strip()[-4000:]
    if returncode == 0:
        return f"a block of removed API ({removed}) ran: the names are back"
    missing = [n for n in str(removed).split(",") if n not in output]
    if missing:
        return (f"a block of removed API failed without naming {', '.join(missing)}:\n"
                + output.strip()[-4000:])
    return ""


def python_env(args) -> dict:
    """The environment snippets and generators run in: the built package first."""
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(args.pythonpath)]
            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def check_generated(root: Path, md: Path, args) -> list[str]:
    """Checks (or with --fix rewrites) the generated regions of one Markdown file."""
    lines = md.read_text(encoding="utf-8").splitlines(keepends=True)
    out, failures, i, changed = [], [], 0, False
    while i < len(lines):
        m = GENERATED.match(lines[i])
        out.append(lines[i])
        i += 1
        if not m:
            continue
        start = i
        while i < len(lines) and not END_GENERATED.match(lines[i]):
            i += 1
        where = f"{md.relative_to(root)}:{start}"
        if i == len(lines):
            failures.append(f"check-snippets: {where}: generated region without its end")
            break
        script = root / "tools" / "snippets" / (m.group(1) + ".py")
        r = subprocess.run([args.python, str(script)], env=python_env(args),
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            failures.append(f"check-snippets: {where}: {script.name} failed:\n"
                            + (r.stdout + r.stderr)[-4000:])
            out.extend(lines[start:i])
            continue
        want = r.stdout if r.stdout.endswith("\n") or not r.stdout else r.stdout + "\n"
        have = "".join(lines[start:i])
        if have != want:
            if args.fix:
                changed = True
            else:
                failures.append(f"check-snippets: {where}: the region differs from what "
                                f"{script.relative_to(root)} prints (tools/check-snippets.py "
                                "--fix rewrites it)")
        out.append(want if args.fix else have)
    if changed and not failures:
        md.write_text("".join(out), encoding="utf-8")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--pythonpath", default="")
    ap.add_argument("--cxx", default=os.environ.get("CXX", "c++"))
    ap.add_argument("--include", action="append", default=[],
                    help="another include folder (the build's generated headers)")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                    help="blocks run at once (default: the CPUs, at most 4)")
    ap.add_argument("--list", action="store_true", help="list the snippets, run nothing")
    ap.add_argument("--fix", action="store_true", help="rewrite the generated regions")
    args = ap.parse_args()
    root = Path(args.root).resolve()
    failures, jobs, together = [], [], []  # together: the cpp blocks compiled as one unit
    for md in markdown_files(root):
        if not args.list:
            failures += check_generated(root, md, args)
        previous = []  # the file's python blocks so far, for `continues`
        for s in snippets_of(md, root):
            if s.lang not in ("python", "cpp"):
                continue
            if args.list:
                print(f"{s.where()} {s.lang} {' '.join(s.directives)}")
                continue
            if s.lang == "cpp":
                if s.directives.get("removed"):
                    jobs.append((s, run_cpp, s))
                else:
                    together.append(s)
                continue
            if s.directives.get("continues") and not previous:
                failures.append(f"check-snippets: {s.where()} (python) failed:\n"
                                "'continues' with no python block before it")
                continue
            chain = (previous[-1] + [s]) if s.directives.get("continues") else [s]
            previous.append(chain)
            jobs.append((s, run_python, chain))
    if args.list:
        return 0

    def run(job) -> str:
        s, fn, what = job
        try:
            return fn(root, what, args)
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            return str(e)

    def run_together(blocks: list[Snippet]) -> list[str]:
        try:
            return run_cpp_together(root, blocks, args)
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            return [str(e)] * len(blocks)

    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        batch = pool.submit(run_together, together)
        results = list(pool.map(run, jobs))
        jobs += [(s, run_cpp, s) for s in together]
        results += batch.result()
    skipped = 0
    for (s, _, _), why in zip(jobs, results):
        if why == SKIP:
            skipped += 1
            print(f"check-snippets: {s.where()} ({s.lang}) {SKIP}")
        elif why:
            failures.append(f"check-snippets: {s.where()} ({s.lang}) failed:\n{why}")
    for f in failures:
        print(f, file=sys.stderr)
    note = f", {skipped} skipped (no CUDA)" if skipped else ""
    print(f"check-snippets: {len(jobs)} snippets, {len(failures)} failed{note}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
