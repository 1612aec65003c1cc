"""Installed size per extra: a fresh venv per extra, ``pip install CHECKOUT[EXTRA]``, then the
size of its site-packages and the number of distributions pip lists (pip itself left out).

    python benchmarks/install_sizes.py                 # base, sim, gateway, postgres, web, dev
    python benchmarks/install_sizes.py --extras "" sim # a subset ("" is the base install)

Needs the network (PyPI) and a few minutes per extra; prints one JSON line per extra.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _du(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = Path(dirpath) / f
            if not p.is_symlink():
                total += p.stat().st_size
    return total


def measure(extra: str, work: Path) -> dict:
    venv = work / (extra or "base")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    target = f"{ROOT}[{extra}]" if extra else str(ROOT)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", target], check=True)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    listed = json.loads(subprocess.run([str(py), "-m", "pip", "list", "--format", "json",
                                        "--disable-pip-version-check"], capture_output=True, text=True,
                                       check=True).stdout)
    names = sorted(d["name"].lower() for d in listed if d["name"].lower() not in ("pip", "setuptools", "wheel"))
    return {"extra": extra or "(base)", "site_packages_mib": round(_du(site) / 2**20, 1), "packages": len(names),
            "names": names}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extras", nargs="*", default=["", "sim", "gateway", "postgres", "web", "dev"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgeflow-sizes-") as tmp:
        for extra in args.extras:
            print(json.dumps(measure(extra, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
