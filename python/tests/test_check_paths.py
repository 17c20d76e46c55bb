"""tools/check-paths.py, the tree check of the test command: a doc or comment naming a
path that does not exist, a tracked file outside the layout, and a program installed from
tools/ each fail it; a clean tree passes."""
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "tools" / "check-paths.py"


def repo(tmp_path, files):
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    return subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True,
                          text=True)


def test_a_clean_tree_passes(tmp_path):
    r = repo(tmp_path, {"README.md": "See `kernels/plans.hpp` and `host/crc32c.{hpp,cpp}`.\n",
                        "kernels/plans.hpp": "// The plans; tests/test_plans runs them.\n",
                        "tests/test_plans.cpp": "", "host/crc32c.hpp": "",
                        "host/crc32c.cpp": "", "docs/x.md": "A glob: `tests/*.cpp`.\n"})
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_missing_path_and_a_stray_file_fail(tmp_path):
    r = repo(tmp_path, {"README.md": "The reference lives in `src/reference`.\n",
                        "core/a.hpp": "// computes it (core/norm.cpp)\n",
                        "crash-0123": "x"})
    assert r.returncode == 1
    assert "README.md: names 'src/reference'" in r.stdout
    assert "core/a.hpp (a comment): names 'core/norm.cpp'" in r.stdout
    assert "crash-0123: a tracked file outside the layout" in r.stdout


def test_a_shipped_program_in_tools_fails(tmp_path):
    r = repo(tmp_path, {"tools/CMakeLists.txt":
                        "add_executable(x x.cpp)\ninstall(TARGETS x RUNTIME DESTINATION bin)\n",
                        "tools/x.cpp": "", "apps/CMakeLists.txt": "install(TARGETS y)\n"})
    assert r.returncode == 1
    assert "tools/CMakeLists.txt: tools/ installs a program" in r.stdout
    assert "apps/" not in r.stdout.replace("shipped programs live in apps/", "")
