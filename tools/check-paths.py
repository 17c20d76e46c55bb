#!/usr/bin/env python3
"""Fails when a doc or a comment names a repository path that does not exist, or when
the repository tracks a file outside its known layout.

    check-paths.py [ROOT]      (exit 0: clean; 1: each problem printed; 2: not a checkout)

Paths: in every tracked Markdown file and in the comments of every tracked source file
(C++, CUDA, CMake, Python, shell), a word that starts with one of the repository's
top-level folders (or the retired `src/`) and a slash, such as `kernels/plans.hpp`, must
name a tracked file or folder; `host/crc32c.{hpp,cpp}` names each, and `tests/test_device` (a
program built from `tests/test_device.cpp`) counts as its source. Globs (`*`), placeholders
(`<...>`) and build outputs (`build/...`) are not paths of the tree and are skipped. Layout: every tracked file lies
in a known top-level folder or is one of the known top-level files, and tools/ (build, test
and CI scripts) installs nothing: the shipped programs live in apps/.
"""
import pathlib
import re
import subprocess
import sys

FOLDERS = ["apps", "bench", "cmake", "comm", "core", "cpu", "device", "diff", "docs", "examples", "host",
           "include", "kernels", "managers", "python", "reference", "tests", "tools", ".ci"]
TOP_FILES = {"README.md", "CONTRIBUTING.md", "CMakeLists.txt", "CMakePresets.json",
             "pyproject.toml", ".gitignore", ".clang-format"}
RETIRED = ["src"]  # the tree's old root: a path under it is stale
# Paths outside the tree that read like the tree's (an NCCL root's, a system prefix's).
EXTERNAL = {"include/nccl.h"}

SOURCE = re.compile(r"\.(hpp|cpp|cu|cuh|h|py|sh|cmake|txt|toml)$")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(f) for f in FOLDERS + RETIRED)
                  + r")/[A-Za-z0-9_.+/-]*[A-Za-z0-9_+/])")


def comments(path, text):
    """The comment text of a source file (line comments; Python docstrings and # lines)."""
    if path.suffix in (".py", ".sh", ".cmake", ".txt", ".toml") or path.name == "CMakeLists.txt":
        lines = [l.split("#", 1)[1] for l in text.splitlines() if "#" in l]
        if path.suffix == ".py":
            lines += re.findall(r'"""(.*?)"""', text, re.S)
        return "\n".join(lines)
    return "\n".join(l.split("//", 1)[1] for l in text.splitlines() if "//" in l)


def main(argv):
    root = pathlib.Path(argv[1] if len(argv) > 1 else pathlib.Path(__file__).parents[1])
    try:
        files = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True,
                               text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        print("check-paths: not a git checkout: nothing to check", file=sys.stderr)
        return 2
    tracked = set(files)
    folders = {str(pathlib.PurePosixPath(f).parent) for f in files}
    folders |= {str(p) for f in files for p in pathlib.PurePosixPath(f).parents}
    problems = []
    for f in files:
        top = f.split("/", 1)[0]
        if "/" not in f and f not in TOP_FILES:
            problems.append(f"{f}: a tracked file outside the layout (top level)")
        elif "/" in f and top not in FOLDERS:
            problems.append(f"{f}: a tracked file outside the layout (folder {top}/)")
        elif top == "tools" and f.endswith("CMakeLists.txt") and "install(" in (root / f).read_text(
                encoding="utf-8", errors="replace"):
            problems.append(f"{f}: tools/ installs a program; shipped programs live in apps/")
    for f in files:
        p = root / f
        is_doc = f.endswith(".md")
        if not (is_doc or SOURCE.search(f)) or f.startswith("tests/fuzz/corpus/"):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        body = text if is_doc else comments(p, text)
        for line_no, line in enumerate(body.splitlines(), 1):
            for m in PATH.finditer(line):
                name = m.group(1).rstrip("/.")
                rest = line[m.end():m.end() + 1]
                if "*" in name or rest in ("*", "<") or "<" in line[m.start():m.end() + 2]:
                    continue
                braces = re.match(r"\.\{([^}]*)\}", line[m.end():])
                names = [f"{name}.{ext}" for ext in braces.group(1).split(",")] if braces else [name]
                if all(n in tracked or n in folders or n in EXTERNAL or
                       any(n + ext in tracked for ext in (".cpp", ".cu")) for n in names):
                    continue
                where = f if is_doc else f"{f} (a comment)"
                problems.append(f"{where}: names '{name}', which does not exist")
    for problem in problems:
        print("check-paths:", problem)
    if not problems:
        print(f"check-paths: {len(files)} files: every named path exists, the layout holds")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
