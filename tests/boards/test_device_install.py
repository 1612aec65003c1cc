"""What a board's install pulls, how it names missing parts, and the detection overrides.

No emulation here: the dependency markers are evaluated for each board's platform, and the
device commands run on this host with the optional packages made unimportable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from edgeflow.profiles import BOARD_MODEL_ENV, PROFILE_ENV, HostFacts, detect, detect_with_reason

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import run as harness  # noqa: E402

try:
    from packaging.requirements import Requirement
except ImportError:  # pragma: no cover - pip vendors it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

DEVICE_CORE = {"numpy", "paho-mqtt", "protobuf", "rich", "threadpoolctl"}


def _required(env: dict[str, str], extra: str = "") -> set[str]:
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(proj["dependencies"]) + (list(proj["optional-dependencies"][extra]) if extra else [])
    names = set()
    for r in map(Requirement, reqs):
        if r.marker is None or r.marker.evaluate({**env, "extra": extra}):
            names.add(r.name.lower())
    return names


@pytest.mark.parametrize("arch,extra_names", [
    ("armv7", set()),  # no onnx/onnxruntime/cffi wheels: Debian's or edgeflow's fallbacks
    ("riscv64", set()),  # no onnx/onnxruntime/cryptography wheels
    ("aarch64", {"onnx", "onnxruntime", "cryptography"}),  # wheels exist; no demo deps on a board
])
def test_a_board_install_requires_only_the_device_runtime(arch: str, extra_names: set[str]) -> None:
    env = harness._marker_env(harness.ARCHES[arch])
    assert _required(env) == DEVICE_CORE | extra_names
    assert {"scikit-learn", "amqtt"} <= _required(env, "demo")
    assert {"onnx", "cryptography"} <= _required(env, "gateway")


def test_the_readme_install_on_x86_has_everything() -> None:
    """The README's `pip install '.[sim]' && edgeflow demo` brings the demo's data and broker; a plain
    `pip install .` on x86 is the device runtime only (issue 33: no scikit-learn or amqtt there)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert "pip install '.[sim]' && edgeflow demo" in readme
    env = {**harness._marker_env(harness.ARCHES["aarch64"]), "platform_machine": "x86_64"}
    assert _required(env) == DEVICE_CORE | {"onnx", "onnxruntime", "cryptography"}
    assert _required(env, "sim") >= DEVICE_CORE | {"onnx", "onnxruntime", "cryptography", "scikit-learn", "amqtt"}


def test_detect_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROFILE_ENV, "visionfive-2")
    prof, how = detect_with_reason()
    assert prof.name == "visionfive-2" and PROFILE_ENV in how
    monkeypatch.delenv(PROFILE_ENV)
    monkeypatch.setenv(BOARD_MODEL_ENV, "Raspberry Pi 4 Model B Rev 1.4")
    prof, how = detect_with_reason()
    assert prof.name == "raspberry-pi-4" and "Raspberry Pi 4 Model B" in how
    # explicit facts are not overridden: tests and tools that pass facts get what they ask for
    monkeypatch.setenv(PROFILE_ENV, "visionfive-2")
    assert detect(HostFacts("armv7l", 1, 512, (), "TI AM335x BeagleBone Black")).name == "beaglebone-black"


def _cli(args: list[str], env: dict[str, str], block: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import sys
        for name in {list(block)!r}:
            sys.modules[name] = None  # as if not installed: import raises ModuleNotFoundError
        from edgeflow.cli.main import main
        sys.exit(main({args!r}))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


BARE = ("onnxruntime", "cryptography", "sklearn", "amqtt")


def test_detect_names_every_missing_part_without_a_traceback() -> None:
    r = _cli(["profile", "detect"], {"EDGEFLOW_ONNX": "compat", BOARD_MODEL_ENV: "StarFive VisionFive 2"}, BARE)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "visionfive-2" in out and "detected by: board model 'StarFive VisionFive 2'" in out
    assert "onnxruntime: not installed" in out and "numpy backend" in out
    assert "cryptography: not installed -> instead: pure-Python Ed25519" in out
    assert "onnx: not used: EDGEFLOW_ONNX=compat -> instead: edgeflow.onnx_compat" in out
    assert "Traceback" not in r.stderr
    assert "pure-Python RFC 8032" in r.stderr, "one warning line names the signing fallback at start"


def test_device_commands_run_without_the_optional_packages(tmp_path: Path) -> None:
    import numpy as np
    import onnx

    from edgeflow import zoo

    onnx.save(zoo.digits_mlp(seed=0), str(tmp_path / "m.onnx"))
    np.save(tmp_path / "x.npy", np.random.default_rng(0).random((4, 64), dtype=np.float32))
    env = {"EDGEFLOW_ONNX": "compat", PROFILE_ENV: "raspberry-pi-zero-2w"}
    r = _cli(["run", str(tmp_path / "m.onnx"), "-i", str(tmp_path / "x.npy"), "--json"], env, BARE)
    assert r.returncode == 0, r.stderr
    r = _cli(["inspect", str(tmp_path / "m.onnx")], env, BARE)
    assert r.returncode == 0, r.stderr
    r = _cli(["device", "--credentials", str(tmp_path / "nope")], env, BARE)
    assert r.returncode != 0 and "Traceback" not in r.stderr and r.stderr.strip(), r.stderr


def test_an_unknown_forced_profile_is_one_line() -> None:
    r = _cli(["profile", "detect"], {PROFILE_ENV: "raspberry-pi-9"})
    assert r.returncode != 0 and "unknown device profile 'raspberry-pi-9'" in r.stderr
    assert "Traceback" not in r.stderr


def test_distro_dists_reads_dist_info_and_egg_info(tmp_path: Path) -> None:
    site = tmp_path / "usr" / "lib" / "python3" / "dist-packages"
    (site / "numpy-1.24.2.dist-info").mkdir(parents=True)
    (site / "numpy-1.24.2.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: numpy\nVersion: 1.24.2\n")
    (site / "onnx-1.12.0.egg-info").mkdir()
    (site / "onnx-1.12.0.egg-info" / "PKG-INFO").write_text("Metadata-Version: 1.2\nName: onnx\nVersion: 1.12.0\n")
    (site / "typing_extensions-4.4.0.egg-info").write_text("Name: typing_extensions\nVersion: 4.4.0\n")
    assert harness.distro_dists(tmp_path) == {"numpy": "1.24.2", "onnx": "1.12.0", "typing-extensions": "4.4.0"}


def test_the_device_agent_names_missing_parts_at_start(tmp_path: Path) -> None:
    """A board without onnxruntime and cryptography wheels: `edgeflow device` says so in its first lines,
    with what it uses instead (the numpy backend, pure-Python Ed25519), not only when a model first loads."""
    d = tmp_path / "fleet"
    user = ["--broker-user", "root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    assert _cli(["broker-config", "--dir", str(d), "--fleet", "farm", "--public-host", "localhost", *user],
                {}).returncode == 0
    assert _cli(["fleet", "provision", "cam-1", "--dir", str(d), "--profile", "raspberry-pi-zero-2w"],
                {}).returncode == 0
    code = textwrap.dedent(f"""
        import sys
        for name in {list(BARE)!r}:
            sys.modules[name] = None
        from edgeflow.cli.main import main
        sys.exit(main({["device", "--credentials", str(d / "devices" / "cam-1"), "--broker", "mqtt://127.0.0.1:9",
                        "--state", str(tmp_path / "state")]!r}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "EDGEFLOW_ONNX": "compat"})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stderr is not None
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if line.lstrip().startswith("federated rounds:"):
                break
    finally:
        proc.terminate()
        proc.wait(30)
    text = "\n".join(lines)
    assert "edgeflow device cam-1" in text, text
    assert "missing: onnxruntime: not installed" in text and "numpy backend" in text, text
    assert "missing: cryptography" in text and "pure-Python" in text, text
    assert "Traceback" not in text, text
