"""edgeflow on emulated boards: Debian userlands for armv7, aarch64 and riscv64 under qemu-user.

    python tests/boards/run.py --arch armv7            # full run on one board userland
    python tests/boards/run.py --arch all              # armv7, aarch64, riscv64, one after another
    python tests/boards/run.py --arch armv7 --smoke    # CI: install, detect, one inference, one round
    python tests/boards/run.py --arch riscv64 --fallbacks   # also the pure-Python paths (see below)

For each architecture it

1. builds (once) and caches a Debian userland with debootstrap + qemu-user-static:
   bookworm armhf (Raspberry Pi Zero 2 W / BeagleBone Black), bookworm arm64
   (Pi 4/5, Jetson), trixie riscv64 (VisionFive 2; bookworm has no riscv64 port),
   with the distro packages listed in ``ARCHES`` (numpy and friends from Debian,
   no compiler). The cache is ``/var/cache/edgeflow-boards`` (root) or
   ``~/.cache/edgeflow/boards``; ``EDGEFLOW_BOARDS_CACHE`` overrides. A cached
   userland is reused while its package list is unchanged;
2. builds the edgeflow wheel on the host, downloads on the host
   (``pip download --platform ... --only-binary=:all:``) every dependency the
   distro does not already satisfy, and installs the wheel into a venv with
   ``--system-site-packages`` inside the userland, offline (``--no-index``).
   Nothing compiles: the userland has no compiler and any sdist would fail;
3. runs inside the userland:
   - ``edgeflow profile detect`` with ``EDGEFLOW_BOARD_MODEL`` standing in for the
     device-tree model string qemu hides (and ``EDGEFLOW_PROFILE`` checked too);
   - the numpy backend's conformance subset: one small ONNX node case per op the
     numpy backend claims, exported on the host to .onnx/.npz (cached);
   - a real third-party model from ``edgeflow.model_suite`` when that module
     exists (else the zoo CNN, and the report says so) through ``edgeflow run``,
     compared with the host's onnxruntime;
   - ``edgeflow device`` (the board's agent) joining a fleet on a Mosquitto that
     the host starts with ``edgeflow broker-config``'s TLS+ACL config: signed OTA
     of the first model (health checked), a federated round driven by
     ``edgeflow gateway`` on the host together with a host device, then the
     round's model deployed to the board as a second signed OTA artifact that
     must pass its health check;
4. records per arch: build/install times, what passed, timings, in
   ``<cache>/<arch>/last-run.json``, and prints a summary.

``--fallbacks`` repeats detect, conformance, model and round with
``EDGEFLOW_ONNX=compat EDGEFLOW_SIGNING=pure`` on the board: the paths a board
with no compiled onnx and no cryptography takes.

Needs root (chroot, mounts), debootstrap, qemu-user-static with binfmt_misc
(``apt-get install qemu-user-static debootstrap binfmt-support``), mosquitto,
and on the host the editable install with onnx and onnxruntime. The chroot
shares the host's network namespace: the board reaches the host's broker on
127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import email.parser
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MIRROR = os.environ.get("EDGEFLOW_BOARDS_MIRROR", "http://deb.debian.org/debian")
VENV = "/opt/edgeflow"  # inside the userland
FLEET = "lab"
BOARD_ID = "board"
HOST_ID = "host"


@dataclass(frozen=True)
class Arch:
    name: str
    debian: str  # Debian architecture
    suite: str
    qemu: str  # binfmt_misc entry: qemu-<qemu>
    machine: str  # platform.machine() inside
    python: str  # the suite's python3 (major.minor)
    glibc: str  # for manylinux_<glibc>_<machine> wheel tags
    packages: tuple[str, ...]  # from the distro
    profile: str  # what detect must find
    board_model: str  # device-tree model string of that board
    onnxruntime: bool = False  # the install gets onnxruntime (distro or PyPI)

    @property
    def platforms(self) -> list[str]:
        """Wheel platform tags the board's glibc accepts (pip does not expand --platform to older glibcs)."""
        major, minor = (int(x) for x in self.glibc.split("."))
        tags = [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 16, -1)]
        return [*tags, f"manylinux2014_{self.machine}", f"linux_{self.machine}"]


_BASE = ("python3", "python3-venv", "python3-pip", "python3-numpy", "ca-certificates")
ARCHES: dict[str, Arch] = {
    # PyPI has no numpy, onnx, onnxruntime or cffi wheel for armv7l: Debian's numpy 1.24,
    # onnx 1.12, cryptography 38 (+ its cffi backend) and protobuf 3.21.
    "armv7": Arch("armv7", "armhf", "bookworm", "arm", "armv7l", "3.11", "2.36",
                  _BASE + ("python3-onnx", "python3-protobuf", "python3-cryptography", "python3-cffi-backend"),
                  "raspberry-pi-zero-2w", "Raspberry Pi Zero 2 W Rev 1.0"),
    # aarch64 has onnx and onnxruntime wheels on PyPI: they come from there, on Debian's numpy.
    "aarch64": Arch("aarch64", "arm64", "bookworm", "aarch64", "aarch64", "3.11", "2.36",
                    _BASE + ("python3-cryptography", "python3-cffi-backend"),
                    "raspberry-pi-4", "Raspberry Pi 4 Model B Rev 1.4", onnxruntime=True),
    # trixie riscv64 ships what PyPI lacks there: onnx 1.17, cryptography 43, onnxruntime 1.21.
    "riscv64": Arch("riscv64", "riscv64", "trixie", "riscv64", "riscv64", "3.13", "2.41",
                    _BASE + ("python3-onnx", "python3-protobuf", "python3-cryptography", "python3-cffi-backend",
                             "python3-onnxruntime"),
                    "visionfive-2", "StarFive VisionFive 2 v1.3B", onnxruntime=True),
}
SMOKE_ARCH = "armv7"


class HarnessError(RuntimeError):
    """A step failed; the message says which and why."""


def log(msg: str) -> None:
    print(f"[boards {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cache_root() -> Path:
    env = os.environ.get("EDGEFLOW_BOARDS_CACHE")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/edgeflow-boards")
    return Path.home() / ".cache" / "edgeflow" / "boards"


def run(cmd: list[str], *, timeout: float = 1800, check: bool = True, env: dict | None = None,
        cwd: Path | None = None, quiet: bool = False) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and out.returncode != 0:
        tail = (out.stdout[-3000:] + "\n" + out.stderr[-3000:]).strip()
        raise HarnessError(f"{' '.join(map(str, cmd))[:300]} exited {out.returncode}:\n{tail}")
    if not quiet and out.stdout.strip() and os.environ.get("EDGEFLOW_BOARDS_VERBOSE"):
        print(out.stdout)
    return out


# ---------------------------------------------------------------- tools and the userland


def check_tools(arch: Arch) -> None:
    if os.geteuid() != 0:
        raise HarnessError("the board harness needs root (debootstrap, chroot, mounts); run it with sudo")
    missing = [t for t in ("debootstrap", "chroot", "mount") if shutil.which(t) is None]
    if missing:
        raise HarnessError(f"missing {', '.join(missing)}: apt-get install debootstrap qemu-user-static binfmt-support")
    binfmt = Path("/proc/sys/fs/binfmt_misc")
    if not (binfmt / "status").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt)], check=False)
    entry = binfmt / f"qemu-{arch.qemu}"
    if not entry.exists() and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", f"qemu-{arch.qemu}"], check=False, capture_output=True)
    if not entry.exists():
        raise HarnessError(f"no binfmt_misc entry qemu-{arch.qemu}: apt-get install qemu-user-static binfmt-support, "
                           "then mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc; update-binfmts --enable")
    text = entry.read_text()
    if "enabled" not in text.splitlines()[0]:
        subprocess.run(["update-binfmts", "--enable", f"qemu-{arch.qemu}"], check=False, capture_output=True)
    flags = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("flags:")), "")
    if "F" not in flags:
        interp = next((ln.split()[1] for ln in text.splitlines() if ln.startswith("interpreter")), "")
        raise HarnessError(f"qemu-{arch.qemu} is registered without the F (fix binary) flag; the chroot cannot see "
                           f"{interp}: install Debian's qemu-user-static, which registers with F")


def userland_stamp(arch: Arch) -> dict[str, Any]:
    return {"suite": arch.suite, "arch": arch.debian, "packages": sorted(arch.packages), "mirror": MIRROR}


def ensure_userland(arch: Arch, cache: Path, *, rebuild: bool = False) -> tuple[Path, dict[str, Any]]:
    """The cached root file system for ``arch`` (built when missing or its package list changed)."""
    base = cache / arch.name
    rootfs, stamp_file = base / "rootfs", base / "userland.json"
    want = userland_stamp(arch)
    if not rebuild and rootfs.is_dir() and stamp_file.exists():
        have = json.loads(stamp_file.read_text())
        if {k: have.get(k) for k in want} == want:
            return rootfs, {**have, "cached": True}
        log(f"{arch.name}: cached userland has other packages; rebuilding")
    partial = base / "rootfs.partial"
    for d in (rootfs, partial):
        if d.exists():
            _umount_all(d)
            shutil.rmtree(d)
    base.mkdir(parents=True, exist_ok=True)
    log(f"{arch.name}: debootstrap {arch.suite} {arch.debian} (minbase) into {partial}")
    t0 = time.monotonic()
    debs = base / "debs"  # downloaded .debs survive a build that was cut short: a retry only unpacks
    debs.mkdir(parents=True, exist_ok=True)
    run(["debootstrap", f"--arch={arch.debian}", "--variant=minbase", "--include=ca-certificates",
         f"--cache-dir={debs}", arch.suite, str(partial), MIRROR], timeout=3600)
    t1 = time.monotonic()
    # apt resolves what debootstrap's --include does not (virtual packages such as
    # python3-cryptography's python3-cffi-backend-api-min).
    shutil.copy2("/etc/resolv.conf", partial / "etc" / "resolv.conf")
    with mounted(partial, None):
        chroot(partial, ["apt-get", "install", "-y", "-q", "--no-install-recommends", *arch.packages],
               timeout=3600, env={"DEBIAN_FRONTEND": "noninteractive"})
        chroot(partial, ["apt-get", "clean"])
    t2 = time.monotonic()
    partial.rename(rootfs)
    stamp = {**want, "built": time.strftime("%Y-%m-%d %H:%M:%S"), "debootstrap_s": round(t1 - t0, 1),
             "apt_s": round(t2 - t1, 1), "build_s": round(t2 - t0, 1), "bytes": _du(rootfs),
             "distro_python": distro_dists(rootfs)}
    stamp_file.write_text(json.dumps(stamp, indent=1))
    return rootfs, {**stamp, "cached": False}


def _du(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def _mountpoints() -> list[str]:
    with open("/proc/self/mounts", encoding="utf-8") as f:
        return [line.split()[1] for line in f]


def _umount_all(root: Path) -> None:
    prefix = str(root.resolve())
    for mp in sorted((m for m in _mountpoints() if m == prefix or m.startswith(prefix + "/")), reverse=True):
        subprocess.run(["umount", mp], check=False, capture_output=True)
        if mp in _mountpoints():
            subprocess.run(["umount", "-l", mp], check=False, capture_output=True)


@contextlib.contextmanager
def mounted(rootfs: Path, share: Path | None) -> Iterator[None]:
    """/proc, /dev and ``share`` (at the same path inside) for the duration."""
    done: list[Path] = []
    try:
        for src, dst, extra in (("proc", rootfs / "proc", ["-t", "proc"]), ("/dev", rootfs / "dev", ["--bind"]),
                                ("/dev/pts", rootfs / "dev" / "pts", ["--bind"])):
            dst.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", *extra, src, str(dst)], check=True, capture_output=True)
            done.append(dst)
        if share is not None:
            dst = rootfs / str(share).lstrip("/")
            dst.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "--bind", str(share), str(dst)], check=True, capture_output=True)
            done.append(dst)
        yield
    finally:
        for d in reversed(done):
            r = subprocess.run(["umount", str(d)], check=False, capture_output=True)
            if r.returncode != 0:
                subprocess.run(["umount", "-l", str(d)], check=False, capture_output=True)


BOARD_PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def chroot_cmd(rootfs: Path, cmd: list[str], env: dict | None = None) -> list[str]:
    base = {"PATH": BOARD_PATH, "HOME": "/root", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}
    base.update(env or {})
    return ["chroot", str(rootfs), "/usr/bin/env", "-i", *[f"{k}={v}" for k, v in base.items()], *cmd]


def chroot(rootfs: Path, cmd: list[str], *, env: dict | None = None, timeout: float = 1800,
           check: bool = True) -> subprocess.CompletedProcess:
    return run(chroot_cmd(rootfs, cmd, env), timeout=timeout, check=check)


# ---------------------------------------------------------------- the wheel and its dependencies


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def distro_dists(rootfs: Path) -> dict[str, str]:
    """{distribution: version} that the distro's python3 packages installed (dist-info / egg-info)."""
    out: dict[str, str] = {}
    for site in (rootfs / "usr" / "lib" / "python3" / "dist-packages",):
        if not site.is_dir():
            continue
        for d in site.iterdir():
            meta = None
            if d.name.endswith(".dist-info"):
                meta = d / "METADATA"
            elif d.name.endswith(".egg-info"):
                meta = d / "PKG-INFO" if d.is_dir() else d
            if meta is None or not meta.is_file():
                continue
            msg = email.parser.Parser().parsestr(meta.read_text(encoding="utf-8", errors="replace"), headersonly=True)
            if msg.get("Name") and msg.get("Version"):
                out[_canon(msg["Name"])] = msg["Version"]
    return dict(sorted(out.items()))


def build_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("edgeflow-*.whl"):
        old.unlink()
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dest), str(ROOT)]
    with contextlib.suppress(ImportError):
        import setuptools

        if int(setuptools.__version__.split(".")[0]) >= 77:
            cmd.insert(5, "--no-build-isolation")
    run(cmd, timeout=600)
    return next(dest.glob("edgeflow-*.whl"))


def _wheel_requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode("utf-8"), headersonly=True)
    return msg.get_all("Requires-Dist") or []


def _marker_env(arch: Arch) -> dict[str, str]:
    """PEP 508 marker values on the board (tests/boards/test_device_install.py uses them)."""
    return {"platform_machine": arch.machine, "python_version": arch.python, "python_full_version": arch.python + ".0",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "platform_release": "", "platform_version": "",
            "implementation_version": arch.python + ".0", "extra": ""}


PINNED_FROM_DISTRO = ("numpy",)
"""Distributions the board takes from the distro even where a wheel wants a newer one: a wheel
release that needs a newer numpy than Debian's is skipped for an older release (ml_dtypes 0.7
needs numpy 2; Debian bookworm has 1.24)."""


def resolve_wheelhouse(arch: Arch, wheel: Path, rootfs: Path, cache: Path) -> dict[str, Any]:
    """Download on the host, binary only, for the board's platform, what the distro does not satisfy.

    A small resolver, because ``pip download --platform`` evaluates environment
    markers for the host (an x86 host would ask for onnx on armv7): requirements
    are walked from the edgeflow wheel with the board's marker values; one the
    distro satisfies is left to the distro; any other is fetched with
    ``pip download --no-deps --only-binary=:all:`` and its own requirements
    followed. A release whose requirements the distro's pinned packages cannot
    meet is excluded and the next older one fetched.
    """
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
        from pip._vendor.packaging.version import Version  # type: ignore[no-redef]
    distro = distro_dists(rootfs)
    house = cache / arch.name / "wheelhouse"
    house.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(json.dumps([sorted(_wheel_requires(wheel)), distro, arch.platforms,
                                     PINNED_FROM_DISTRO]).encode()).hexdigest()
    lock = house / "resolved.json"
    if lock.exists():
        prev = json.loads(lock.read_text())
        if prev.get("key") == key and all((house / f).exists() for f in prev["files"].values()):
            return {**prev, "cached": True}
    env = _marker_env(arch)
    pyver = arch.python.replace(".", "")
    base = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", arch.python, "--implementation", "cp", "--abi", f"cp{pyver}", "--abi", "abi3",
            "--abi", "none"]
    for plat in arch.platforms:
        base += ["--platform", plat]

    def satisfied_by_distro(req) -> bool:
        have = distro.get(_canon(req.name))
        try:
            return have is not None and req.specifier.contains(Version(have), prereleases=True)
        except Exception:  # noqa: BLE001 - a Debian version packaging cannot parse: not usable as is
            return False

    def applies(req) -> bool:
        return req.marker is None or req.marker.evaluate(env)

    queue = list(_wheel_requires(wheel))
    files: dict[str, str] = {}
    from_distro: dict[str, str] = {}
    skipped: dict[str, list[str]] = {}
    t0 = time.monotonic()
    while queue:
        req = Requirement(queue.pop(0))
        name = _canon(req.name)
        if not applies(req) or name in files or name in from_distro:
            continue
        if satisfied_by_distro(req):
            from_distro[name] = distro[name]
            continue
        excluded: list[str] = []
        for _attempt in range(12):
            spec = req.name + ",".join(x for x in [str(req.specifier), *(f"!={v}" for v in excluded)] if x)
            with tempfile.TemporaryDirectory(dir=house) as tmp:
                try:
                    run([*base, "-d", tmp, spec], timeout=900)
                except HarnessError as exc:
                    raise HarnessError(
                        f"{arch.name}: no binary wheel of {spec} for {arch.platforms[0]} (the distro has "
                        f"{distro.get(name, 'nothing')}): {str(exc)[-400:]}") from exc
                got = next(Path(tmp).glob("*.whl"))
                needs = [Requirement(r) for r in _wheel_requires(got)]
                clash = [str(r) for r in needs if applies(r) and _canon(r.name) in PINNED_FROM_DISTRO
                         and _canon(r.name) in distro and not satisfied_by_distro(r)]
                version = got.name.split("-")[1]
                if clash:
                    excluded.append(version)
                    skipped.setdefault(name, []).append(f"{version} (needs {', '.join(clash)})")
                    continue
                shutil.move(str(got), house / got.name)
                files[name] = got.name
                queue.extend(str(r) for r in needs)
                break
        else:
            raise HarnessError(f"{arch.name}: every recent {req.name} wheel needs more than the distro's "
                               f"{', '.join(PINNED_FROM_DISTRO)}: {skipped.get(name)}")
    result = {"key": key, "files": dict(sorted(files.items())), "from_distro": dict(sorted(from_distro.items())),
              "skipped": skipped, "download_s": round(time.monotonic() - t0, 1)}
    lock.write_text(json.dumps(result, indent=1))
    return {**result, "cached": False}


def install(arch: Arch, rootfs: Path, share: Path, wheel: Path, house: dict[str, Any], cache: Path) -> dict[str, Any]:
    """A fresh venv (system site packages: the distro's numpy) with the wheel, installed offline."""
    whdir = share / "wheelhouse"
    whdir.mkdir(exist_ok=True)
    for f in house["files"].values():
        shutil.copy2(cache / arch.name / "wheelhouse" / f, whdir / f)
    shutil.copy2(wheel, share / wheel.name)
    venv = rootfs / VENV.lstrip("/")
    if venv.exists():
        shutil.rmtree(venv)
    t0 = time.monotonic()
    chroot(rootfs, ["python3", "-m", "venv", "--system-site-packages", VENV])
    out = chroot(rootfs, [f"{VENV}/bin/python", "-m", "pip", "install", "--no-index", "--find-links", str(whdir),
                          str(share / wheel.name)], timeout=3600)
    seconds = time.monotonic() - t0
    built = [ln for ln in out.stdout.splitlines() if "Building wheel" in ln or "setup.py" in ln]
    if built:
        raise HarnessError(f"{arch.name}: the install compiled something: {built}")
    local = json.loads(chroot(rootfs, [f"{VENV}/bin/python", "-m", "pip", "list", "--local", "--format=json"]).stdout)
    every = json.loads(chroot(rootfs, [f"{VENV}/bin/python", "-m", "pip", "list", "--format=json"]).stdout)
    in_venv = {_canon(d["name"]): d["version"] for d in local if _canon(d["name"]) not in ("pip", "setuptools")}
    system = {_canon(d["name"]): d["version"] for d in every if _canon(d["name"]) not in in_venv}
    used = {k: v for k, v in system.items() if k in house["from_distro"]}
    return {"install_s": round(seconds, 1), "from_pypi": dict(sorted(in_venv.items())),
            "from_distro_used": used}


# ---------------------------------------------------------------- host-side material


def export_cases(cache: Path, *, per_op: int = 3, max_bytes: int = 200_000) -> Path:
    """Up to ``per_op`` small ONNX node cases per op the numpy backend claims, as .onnx (shape-inferred) + .npz.

    Cached under ``<cache>/cases/<hash>``; the hash covers the onnx version, the
    kernel sources and the selection settings, so a kernel change re-exports."""
    import numpy as np
    import onnx

    from edgeflow.runtime import conformance

    kernels = sorted((ROOT / "kernels").rglob("*.py"))
    digest = hashlib.sha256(f"{onnx.__version__} {per_op} {max_bytes}".encode())
    for f in kernels:
        digest.update(f.read_bytes())
    out = cache / "cases" / digest.hexdigest()[:16]
    if (out / "manifest.json").exists() and json.loads((out / "manifest.json").read_text())["cases"]:
        return out
    log(f"exporting the conformance subset (onnx {onnx.__version__}) to {out}")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    claimed = conformance.select().claimed
    by_op: dict[str, list] = {}

    def as_array(v) -> np.ndarray:
        return onnx.numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)

    def size(case) -> int:
        inputs, expected = case.data_sets[0]
        return sum(as_array(v).nbytes for v in list(inputs) + list(expected))

    usable = []
    for c in claimed:
        inputs, expected = c.data_sets[0]
        try:
            arrays = [as_array(v) for v in list(inputs) + list(expected)]
        except (TypeError, ValueError):  # sequences/optionals are not plain arrays: not in the subset
            continue
        if any(a.dtype == object for a in arrays):
            continue
        usable.append(c)
    for c in sorted(usable, key=lambda c: (c.name.endswith("_expanded"), size(c), c.name)):
        ops = sorted({n.op_type for n in c.model.graph.node})
        key = ops[0] if len(ops) == 1 else "+".join(ops)
        if len(ops) == 1 and len(by_op.setdefault(key, [])) < per_op and size(c) <= max_bytes:
            by_op[key].append(c)
    cases = []
    for op, picked in sorted(by_op.items()):
        for c in picked:
            inputs, expected = c.data_sets[0]
            model = onnx.shape_inference.infer_shapes(c.model)
            onnx.save(model, str(tmp / f"{c.name}.onnx"))
            arrays = {f"in_{i}": as_array(v) for i, v in enumerate(inputs)}
            arrays.update({f"out_{i}": as_array(v) for i, v in enumerate(expected)})
            np.savez(tmp / f"{c.name}.npz", **arrays)
            cases.append({"name": c.name, "ops": [op], "model": f"{c.name}.onnx", "data": f"{c.name}.npz",
                          "inputs": [i.name for i in c.model.graph.input][: len(inputs)],
                          "outputs": [o.name for o in c.model.graph.output][: len(expected)],
                          "rtol": float(c.rtol), "atol": float(c.atol),
                          "opset": next((int(i.version) for i in c.model.opset_import if i.domain in ("", "ai.onnx")),
                                        0)})
    if not cases:
        raise HarnessError(f"no conformance case selected from {len(claimed)} claimed ones")
    manifest = {"onnx": onnx.__version__, "claimed": len(claimed), "ops": len(by_op), "cases": cases}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def suite_model(share: Path, explicit: tuple[str, str] | None) -> dict[str, Any]:
    """The model for the inference check: given, a real-model-suite model, or the zoo CNN."""
    import numpy as np
    import onnx

    target = share / "model.onnx"
    if explicit:
        shutil.copy2(explicit[0], target)
        shutil.copy2(explicit[1], share / "model-input.npz")
        return {"model": Path(explicit[0]).name, "source": "given with --model"}
    try:
        from edgeflow import model_suite as ms  # the real-model suite, where this checkout has it
    except ImportError:
        ms = None
    # openWakeWord's speech-embedding CNN (1.3 MB, TF export): small enough for qemu, real third-party
    name = os.environ.get("EDGEFLOW_BOARDS_SUITE_MODEL", "oww-embedding")
    if ms is not None:
        try:
            shutil.copy2(ms.model_path(name), target)
            feeds = ms.build_inputs(name)
            np.savez(share / "model-input.npz", **{k: np.asarray(v) for k, v in feeds.items()})
            return {"model": name, "source": "edgeflow.model_suite"}
        except Exception as exc:  # noqa: BLE001 - offline or not fetched: say so, use the zoo CNN
            log(f"model suite model {name} unavailable ({exc}); using the zoo CNN")
            reason = f"edgeflow.model_suite could not provide {name}: {exc}"
    else:
        reason = "edgeflow.model_suite is not in this checkout"
    from edgeflow import zoo

    onnx.save(zoo.small_cnn(seed=0), str(target))
    x = np.random.default_rng(0).random((2, 1, 28, 28), dtype=np.float32)
    np.savez(share / "model-input.npz", input=x)
    return {"model": "zoo.small_cnn", "source": f"zoo CNN ({reason})"}


def ort_reference(share: Path) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(share / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = dict(np.load(share / "model-input.npz"))
    outs = sess.run(None, feeds)
    names = [o.name for o in sess.get_outputs()]
    np.savez(share / "model-ort-host.npz", **dict(zip(names, outs)))
    return {"outputs": names, "onnxruntime": ort.__version__}


def compare_outputs(share: Path, got_file: Path, *, rtol: float = 1e-3, atol: float = 1e-4) -> dict[str, Any]:
    import numpy as np

    want = dict(np.load(share / "model-ort-host.npz"))
    got = dict(np.load(got_file))
    worst = 0.0
    for k, w in want.items():
        if k not in got:
            return {"ok": False, "detail": f"output {k} missing (got {sorted(got)})"}
        g = got[k]
        if g.shape != w.shape:
            return {"ok": False, "detail": f"output {k} shape {g.shape} != {w.shape}"}
        if w.dtype.kind == "f":
            err = float(np.max(np.abs(g.astype(np.float64) - w)) if w.size else 0.0)
            worst = max(worst, err)
            if not np.allclose(g, w, rtol=rtol, atol=atol):
                return {"ok": False, "detail": f"output {k}: max |diff| {err:.3g} > atol {atol} + rtol {rtol}"}
        elif not np.array_equal(g, w):
            return {"ok": False, "detail": f"output {k} differs"}
    return {"ok": True, "max_abs_diff": worst}


# ---------------------------------------------------------------- the fleet round


class Procs:
    """Processes started for a run; all stopped (TERM, then KILL) at the end."""

    def __init__(self) -> None:
        self.items: list[tuple[str, subprocess.Popen, Any]] = []

    def start(self, name: str, cmd: list[str], log_file: Path, env: dict | None = None) -> subprocess.Popen:
        fh = open(log_file, "ab")  # noqa: SIM115 - closed in stop()
        p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.items.append((name, p, fh))
        return p

    def stop(self) -> None:
        """Newest first (the agents before the broker they talk to), TERM then KILL after 30 s."""
        for _, p, fh in reversed(self.items):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            fh.close()
        self.items.clear()


def _cli() -> list[str]:
    return [sys.executable, "-m", "edgeflow.cli.main"]


def _edgeflow(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run([*_cli(), *args], timeout=timeout)


def _wait_for(pred, timeout: float, what: str, interval: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise HarnessError(f"timed out after {timeout:.0f} s waiting for {what}")


def fleet_round(arch: Arch, rootfs: Path, share: Path, *, rounds: int, second_ota: bool,
                board_env: dict[str, str]) -> dict[str, Any]:
    """Board agent + host agent + host gateway over TLS Mosquitto: OTA v1, rounds, OTA of the result."""
    import numpy as np
    import onnx

    from edgeflow import zoo
    from edgeflow.broker.mosquitto import FleetDir, ListenerSettings
    from edgeflow.data.datasets import dirichlet_partition, load_digits
    from edgeflow.gateway.store import GatewayStore
    from edgeflow.transport.broker import find_mosquitto, free_port, wait_for_port

    mosquitto = find_mosquitto()
    if mosquitto is None:
        raise HarnessError("mosquitto is not installed on the host: apt-get install mosquitto")
    res: dict[str, Any] = {}
    fdir = share / "fleet"
    fd = FleetDir(fdir).init(FLEET)
    fd.provision(BOARD_ID, profile=arch.profile)
    fd.provision(HOST_ID, profile="x86-gateway")
    port = free_port()
    files = fd.write_broker_config(ListenerSettings(host="127.0.0.1", port=port, log_file=str(share / "mosquitto.log")),
                                   tls_hosts=["localhost", "127.0.0.1"])
    url = f"mqtts://127.0.0.1:{port}"
    split = load_digits(seed=0).flat()
    parts = dirichlet_partition(split.y_train, 2, alpha=1.0, seed=0)
    for dev, idx in zip((BOARD_ID, HOST_ID), parts):
        np.savez(share / f"{dev}.npz", x=split.x_train[idx], y=split.y_train[idx])
    np.savez(share / "eval.npz", x=split.x_test, y=split.y_test)
    onnx.save(zoo.digits_mlp(seed=0), str(share / "model.v1.onnx"))
    procs = Procs()
    try:
        procs.start("mosquitto", [mosquitto, "-c", str(files.config)], share / "mosquitto.out")
        if not wait_for_port("127.0.0.1", port, 15):
            raise HarnessError(f"mosquitto did not start: {(share / 'mosquitto.out').read_text()[-1000:]}")
        t0 = time.monotonic()
        board = procs.start("board", chroot_cmd(rootfs, [
            "edgeflow", "device", "--credentials", str(fd.device_dir(BOARD_ID)), "--broker", url,
            "--state", str(share / "state" / BOARD_ID), "--telemetry-interval", "2",
            "--train-data", str(share / f"{BOARD_ID}.npz")], board_env), share / "board.log")
        procs.start("host-device", [*_cli(), "device", "--credentials", str(fd.device_dir(HOST_ID)), "--broker", url,
                                    "--state", str(share / "state" / HOST_ID), "--telemetry-interval", "2",
                                    "--train-data", str(share / f"{HOST_ID}.npz")], share / "host-device.log")

        def online() -> bool:
            if board.poll() is not None:
                raise HarnessError(f"the board agent exited {board.returncode}:\n{_tail(share / 'board.log')}")
            out = run([*_cli(), "fleet", "status", "--dir", str(fdir), "--broker", url, "--wait", "2", "--json"],
                      check=False, timeout=120)
            try:
                rows = json.loads(out.stdout)
            except ValueError:
                return False
            rows = rows["devices"] if isinstance(rows, dict) else rows
            return {r.get("device") or r.get("device_id") for r in rows if r.get("online")} >= {BOARD_ID, HOST_ID}

        _wait_for(online, 300, "the board and host agents to come online")
        res["agent_online_s"] = round(time.monotonic() - t0, 1)

        def deploy(model: Path, to: str) -> dict[str, Any]:
            t = time.monotonic()
            out = _edgeflow("fleet", "deploy", str(model), "--to", to, "--dir", str(fdir), "--broker", url,
                            "--canary", "1", "--timeout", "600", "--wait", "5", "--json", timeout=900)
            rep = json.loads(out.stdout)
            if rep.get("state") != "completed" or set(rep.get("counts", {})) != {"ok"}:
                raise HarnessError(f"OTA deploy of {model.name} to {to} did not complete: {rep}\n"
                                   f"{_tail(share / 'board.log')}")
            return {"version": rep["version"], "counts": rep["counts"], "seconds": round(time.monotonic() - t, 1)}

        res["ota_v1"] = deploy(share / "model.v1.onnx", "all")
        for dev in (BOARD_ID, HOST_ID):
            ack = json.loads(_edgeflow("fleet", "cmd", dev, "train_start", "--dir", str(fdir), "--broker", url,
                                       "--json").stdout)
            if not ack.get("ok"):
                raise HarnessError(f"train_start refused by {dev}: {ack}")
        (share / "gw.toml").write_text(
            '[gateway]\nstate = "gw.sqlite"\nmodel = "model.v1.onnx"\neval = "eval.npz"\nmetrics = "metrics.jsonl"\n'
            f'[rounds]\nrounds = {rounds}\nmin_clients = 2\nfraction = 1.0\ndeadline_s = 600\n'
            '[rounds.train]\nepochs = 1\nlr = 0.1\ncodec = "topk-int8"\ncodec_opts = { ratio = 0.1 }\n')
        t = time.monotonic()
        gw = _edgeflow("gateway", "--config", str(share / "gw.toml"), "--dir", str(fdir), "--broker", url, "--json",
                       timeout=1800)
        metrics = [json.loads(ln) for ln in gw.stdout.splitlines() if ln.startswith("{")]
        if len(metrics) != rounds or any(m["participants"] != 2 or m["rejected"] for m in metrics):
            raise HarnessError(f"federated rounds did not include both devices: {metrics}\n{_tail(share / 'board.log')}")
        res["rounds"] = [{"round": m["round_id"], "participants": m["participants"], "accuracy": m.get("accuracy"),
                          "round_s": round(m.get("round_s", 0.0), 1)} for m in metrics]
        res["rounds_s"] = round(time.monotonic() - t, 1)
        if second_ota:
            version, data, _ = GatewayStore(share / "gw.sqlite").latest_model()
            (share / "model.trained.onnx").write_bytes(data)
            res["ota_trained"] = {**deploy(share / "model.trained.onnx", f"device={BOARD_ID}"),
                                  "global_model_version": version}
            status = json.loads(_edgeflow("fleet", "status", "--dir", str(fdir), "--broker", url, "--wait", "3",
                                          "--json").stdout)
            rows = status["devices"] if isinstance(status, dict) else status
            row = next(r for r in rows if (r.get("device") or r.get("device_id")) == BOARD_ID)
            res["board_status"] = {k: row.get(k) for k in ("model_version", "health", "profile", "online")}
    finally:
        procs.stop()
    res["board_log_tail"] = _tail(share / "board.log", 12)
    return res


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------- one architecture


@dataclass
class Report:
    arch: str
    steps: dict[str, Any] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def step(self, name: str, fn, *args, **kw) -> Any:
        t0 = time.monotonic()
        log(f"{self.arch}: {name} ...")
        try:
            out = fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001 - recorded, reported, the run goes on to the next step
            self.steps[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                "seconds": round(time.monotonic() - t0, 1)}
            self.failed.append(name)
            log(f"{self.arch}: {name} FAILED: {str(exc)[:2000]}")
            return None
        rec = out if isinstance(out, dict) else {"value": out}
        rec.setdefault("ok", True)
        rec["seconds"] = round(time.monotonic() - t0, 1)
        self.steps[name] = rec
        if rec["ok"] is False:
            self.failed.append(name)
        log(f"{self.arch}: {name} {'ok' if rec['ok'] else 'FAILED'} ({rec['seconds']} s)")
        return out


def detect_on_board(arch: Arch, rootfs: Path, env: dict[str, str]) -> dict[str, Any]:
    out = chroot(rootfs, ["edgeflow", "profile", "detect", "--json"],
                 env={**env, "EDGEFLOW_BOARD_MODEL": arch.board_model})
    d = json.loads(out.stdout)
    forced = json.loads(chroot(rootfs, ["edgeflow", "profile", "detect", "--json"],
                               env={**env, "EDGEFLOW_PROFILE": arch.profile}).stdout)
    plain = json.loads(chroot(rootfs, ["edgeflow", "profile", "detect", "--json"], env=env).stdout)
    ok = d["name"] == arch.profile and forced["name"] == arch.profile and plain["arch"] == arch.machine
    parts = {p["part"]: (p["using"] if p["ok"] else f"{p['using']} -> {p['instead']}") for p in d["runtime"]}
    return {"ok": ok, "profile": d["name"], "detected_by": d["detected_by"], "without_override": plain["name"],
            "parts": parts}


def conformance_on_board(rootfs: Path, share: Path, cases: Path, env: dict[str, str], tag: str) -> dict[str, Any]:
    dst = share / "cases"
    if not dst.exists():
        shutil.copytree(cases, dst)
    shutil.copy2(HERE / "inside.py", share / "inside.py")
    out_file = share / f"conformance{tag}.json"
    r = chroot(rootfs, ["python", str(share / "inside.py"), "conformance", str(dst), str(out_file)], env=env,
               check=False, timeout=3600)
    if not out_file.exists():
        raise HarnessError(f"the conformance runner failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    s = json.loads(out_file.read_text())
    bad = [f"{x['name']} ({x['status']}: {x['detail']})" for x in s["results"]
           if x["status"] not in ("pass", "unclaimed")]
    return {"ok": not bad and s["cases"] > 0, "passed": s["passed"], "cases": s["cases"], "board_seconds": s["seconds"],
            "not_passed": bad, "not_claimed_here": s.get("unclaimed", []), "onnx": s["onnx"]}


def model_on_board(arch: Arch, rootfs: Path, share: Path, backend: str, env: dict[str, str], tag: str,
                   model_info: dict[str, Any]) -> dict[str, Any]:
    out = share / f"out-{backend}{tag}.npz"
    t0 = time.monotonic()
    r = chroot(rootfs, ["edgeflow", "run", str(share / "model.onnx"), "--input", str(share / "model-input.npz"),
                        "-o", str(out), "--profile", arch.profile, "--backend", backend, "--allow-over-budget"],
               env=env, check=False, timeout=3600)
    secs = time.monotonic() - t0
    if r.returncode != 0:
        raise HarnessError(f"edgeflow run --backend {backend} exited {r.returncode}: {r.stderr.strip()[-1500:]}")
    cmp = compare_outputs(share, out)
    return {**cmp, "backend": backend, "run_s": round(secs, 1), **model_info}


def run_arch(arch: Arch, args: argparse.Namespace, cache: Path) -> Report:
    rep = Report(arch.name)
    check_tools(arch)
    ul = rep.step("userland", ensure_userland, arch, cache, rebuild=args.rebuild)
    if ul is None:
        return rep
    rootfs, stamp = ul
    rep.steps["userland"] = {"ok": True, "cached": stamp["cached"], "build_s": stamp.get("build_s"),
                             "suite": f"Debian {arch.suite} {arch.debian}", "distro_python": stamp.get("distro_python"),
                             "mb": round(stamp.get("bytes", 0) / 2**20), "seconds": rep.steps["userland"]["seconds"]}
    share = Path(tempfile.mkdtemp(prefix=f"edgeflow-boards-{arch.name}-", dir="/tmp"))
    os.chmod(share, 0o755)
    _umount_all(rootfs)
    try:
        with mounted(rootfs, share):
            wheel = rep.step("wheel", build_wheel, share / "dist")
            if wheel is None:
                return rep
            house = rep.step("wheelhouse", resolve_wheelhouse, arch, wheel, rootfs, cache)
            if house is None:
                return rep
            if rep.step("install", install, arch, rootfs, share, wheel, house, cache) is None:
                return rep
            variants = [("", {})]
            if args.fallbacks:
                variants.append(("-fallbacks", {"EDGEFLOW_ONNX": "compat", "EDGEFLOW_SIGNING": "pure"}))
            cases = None if args.smoke else rep.step("export cases", export_cases, cache)
            model_info = rep.step("reference model", lambda: {**suite_model(share, args.model),
                                                              **ort_reference(share)})
            for tag, env in variants:
                rep.step(f"detect{tag}", detect_on_board, arch, rootfs, env)
                if cases is not None:
                    rep.step(f"conformance{tag}", conformance_on_board, rootfs, share, cases, env, tag)
                if model_info is not None:
                    rep.step(f"model numpy{tag}", model_on_board, arch, rootfs, share, "numpy", env, tag,
                             model_info)
                    if arch.onnxruntime and not tag:
                        rep.step("model ort", model_on_board, arch, rootfs, share, "ort", env, tag, model_info)
                if not args.no_round:
                    sub = share / f"round{tag or '-distro'}"
                    sub.mkdir()
                    rep.step(f"fleet{tag}", fleet_round, arch, rootfs, sub, rounds=1 if args.smoke else 2,
                             second_ota=not args.smoke, board_env=env)
    finally:
        _umount_all(rootfs)
        if args.keep:
            log(f"{arch.name}: kept {share}")
        else:
            shutil.rmtree(share, ignore_errors=True)
    return rep


def summary_line(rep: Report) -> str:
    s = rep.steps
    parts = []
    ul = s.get("userland", {})
    parts.append(f"userland {'cached' if ul.get('cached') else 'built in ' + str(ul.get('build_s')) + ' s'}")
    if "install" in s and s["install"].get("ok"):
        parts.append(f"install {s['install']['install_s']} s")
    for k, v in s.items():
        if k in ("userland", "wheel", "wheelhouse", "install", "export cases", "reference model"):
            continue
        parts.append(f"{k} {'ok' if v.get('ok') else 'FAILED'} ({v.get('seconds')} s)")
    return f"{rep.arch}: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="See docs/boards.md.", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, choices=[*ARCHES, "all"])
    ap.add_argument("--smoke", action="store_true", help="install, detect, one inference, one round (the CI check)")
    ap.add_argument("--fallbacks", action="store_true",
                    help="also run with EDGEFLOW_ONNX=compat EDGEFLOW_SIGNING=pure on the board")
    ap.add_argument("--no-round", action="store_true", help="skip the fleet round")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the userland even if cached")
    ap.add_argument("--userland-only", action="store_true",
                    help="only build (or find cached) the userland and stop: CI gives the build its own time limit")
    ap.add_argument("--keep", action="store_true", help="keep the run folder (logs, outputs)")
    ap.add_argument("--model", nargs=2, metavar=("MODEL.onnx", "INPUT.npz"), help="model for the inference check")
    ap.add_argument("--json-out", help="also write the reports here")
    args = ap.parse_args(argv)

    def on_term(signum, frame):  # noqa: ARG001 - `timeout` sends TERM: unwind, unmount, stop the agents
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    arches = list(ARCHES.values()) if args.arch == "all" else [ARCHES[args.arch]]
    reports = []
    for arch in arches:
        if args.userland_only:
            try:
                _, stamp = ensure_userland(arch, cache, rebuild=args.rebuild)
            except HarnessError as exc:
                print(f"boards: {arch.name}: {exc}", file=sys.stderr)
                return 2
            how = "cached" if stamp.get("cached") else f"built in {stamp.get('build_s')} s"
            print(f"boards: {arch.name}: userland {how} ({stamp.get('suite', arch.suite)} {arch.debian})", flush=True)
            continue
        try:
            rep = run_arch(arch, args, cache)
        except HarnessError as exc:
            print(f"boards: {arch.name}: {exc}", file=sys.stderr)
            return 2
        rec = {"arch": arch.name, "host": platform.node(), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
               "smoke": args.smoke, "steps": rep.steps, "failed": rep.failed}
        (cache / arch.name / "last-run.json").write_text(json.dumps(rec, indent=1, default=str))
        reports.append(rec)
        print(summary_line(rep), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(reports, indent=1, default=str))
    failed = [f"{r['arch']}: {', '.join(r['failed'])}" for r in reports if r["failed"]]
    if failed:
        print("boards: failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
