"""Packaging: every package is listed, and a built wheel installs the fixed
top level into the edgeflow namespace (kernels, gateway, device profiles)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"edgeflow": "edgeflow", "edgeflow.kernels": "kernels", "edgeflow.gateway": "gateway",
          "edgeflow.device_profiles": "device_profiles"}


def _tree_packages() -> set[str]:
    out = set()
    for pkg, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" in rel:
                continue
            out.add(".".join((pkg,) + rel))
    return out


def test_every_package_is_listed_in_pyproject():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"] == MAPPED
    assert set(conf["packages"]) == _tree_packages()


def test_every_folder_with_python_files_is_a_package():
    for folder in MAPPED.values():
        for py in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in py.parts:
                assert (py.parent / "__init__.py").exists(), f"{py.parent} lacks __init__.py"


@pytest.mark.slow
def test_wheel_contains_and_imports_everything(tmp_path):
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)]
    try:  # reuse an installed modern setuptools; else pip fetches one (isolated build)
        import setuptools

        if int(setuptools.__version__.split(".")[0]) >= 77:
            cmd.insert(5, "--no-build-isolation")
    except ImportError:
        pass
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(tmp_path.glob("edgeflow-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for pkg, folder in MAPPED.items():
        for f in (ROOT / folder).rglob("*"):
            if f.suffix in (".py", ".toml") and "__pycache__" not in f.parts:
                rel = f.relative_to(ROOT / folder).as_posix()
                assert f"{pkg.replace('.', '/')}/{rel}" in names, f"{rel} of {folder}/ missing from the wheel"
    assert not any(n.startswith(("kernels/", "gateway/", "device_profiles/")) for n in names), \
        "top-level kernels/gateway would pollute site-packages"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import edgeflow.kernels, edgeflow.gateway, edgeflow.profiles as p; "
            "assert 'x86-gateway' in p.builtin_profiles(); print(edgeflow.kernels.__file__)")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert run.returncode == 0, run.stderr
    assert str(site) in run.stdout


def _requirement_names(reqs: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in reqs}


def test_a_device_runtime_installs_without_the_demo_and_simulation_dependencies():
    """`pip install .` is the device runtime on every machine: scikit-learn (and with it scipy) and amqtt
    serve only `edgeflow demo`/`simulate` and come with the `sim` extra; `dev` still brings everything the
    test suite needs (README: pip install -e '.[dev]'). Sizes per extra: benchmarks/install_sizes.py."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _requirement_names(project["dependencies"])
    extras = {k: _requirement_names(v) for k, v in project["optional-dependencies"].items()}
    assert not core & {"scikit-learn", "scipy", "amqtt"}, core
    assert {"scikit-learn", "amqtt"} <= extras["sim"] and extras["demo"] == extras["sim"]
    for needed in ("sim", "gateway", "web", "postgres"):
        assert extras[needed] - {"psycopg"} <= extras["dev"], (needed, extras[needed] - extras["dev"])
    assert "edgeflow" not in extras["dev"], "PyPI's unrelated 'edgeflow' must never be asked for"
    readme = (ROOT / "README.md").read_text()
    assert "pip install '.[sim]' && edgeflow demo" in readme
    assert "pip install -e '.[dev]'" in readme


@pytest.mark.parametrize("command", ["demo", "simulate"])
def test_the_demo_without_its_extra_says_which_extra_in_one_line(tmp_path, command):
    """A device install (no scikit-learn) running `edgeflow demo` or `simulate`: one line naming the extra,
    exit 2, and nothing else -- no broker started, no blank line from a progress bar (both before).
    scikit-learn is made unimportable the way a missing package is (None in sys.modules)."""
    code = ("import sys; sys.modules['sklearn'] = None; from edgeflow.cli.main import main; "
            f"sys.exit(main([{command!r}]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and "a bug in edgeflow" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "pip install 'edgeflow[sim]'" in lines[0] and "'.[sim]'" in lines[0], out.stderr
    assert out.stdout == "", out.stdout
