"""The Python packages geotrain needs beside torch: found on this interpreter, or unpacked from the wheels
the project ships (scripts/wheels/), or a one-line refusal naming what is missing. Standard library only:
it runs on a bare interpreter (the GPU machine: torch, no pydantic, no network).

    python scripts/gpu_deps.py --target DIR     # ensure; prints what it did; DIR goes on PYTHONPATH
    python scripts/gpu_deps.py --download       # here, with a registry: refresh scripts/wheels/ (CPython 3.12)

Exit status: 0 ready (DIR holds what had to be unpacked), 3 something is missing and no shipped wheel
fits this interpreter (the line says what and how to bring it).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

WHEELS = Path(__file__).resolve().parent / "wheels"
# What the package imports on the paths `geotrain train` and scripts/gpu_check.py take, besides torch
# (pyproject's dependencies; tests/test_gpu_check.py keeps the lists equal). OPTIONAL: imported only on
# other paths or skipped without them (matplotlib draws curves.png and the report's charts; tensorboard writes
# RUN_DIR/tb; pyarrow and zstandard read Parquet/Arrow and .zst training data) -- not shipped (big), reported
# when absent, never refused for.
NEEDED = ["numpy>=1.24", "pydantic>=2.5", "tqdm>=4.66", "safetensors>=0.4", "tokenizers>=0.15", "fastapi>=0.110",
          "uvicorn>=0.29", "prometheus-client>=0.20", "jinja2>=3.1"]
OPTIONAL = ["matplotlib>=3.7", "tensorboard>=2.14", "pyarrow>=14", "zstandard>=0.22"]
SHIPPED_FOR = "3.12"          # the GPU machine's Python; pure-Python wheels fit any
DOWNLOAD = ["pydantic>=2.5", "fastapi>=0.110", "uvicorn>=0.29"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


def parse_req(req: str) -> tuple[str, str | None] | None:
    """(name, lower bound or None) of a requirement; None if it applies only with an extra or to
    another Python than this one (markers beyond these two are taken as applying)."""
    req, _, marker = req.partition(";")
    if "extra" in marker:
        return None
    m = re.search(r"python_version\s*([<>=!]+)\s*['\"]([\d.]+)['\"]", marker)
    if m and not _compare(version_tuple(platform.python_version())[:2], m.group(1), version_tuple(m.group(2))):
        return None
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*\(?([^)]*)\)?", req)
    if not m:
        return None
    low = re.search(r">=\s*([\w.]+)", m.group(2) or "") or re.search(r"==\s*([\w.]+)", m.group(2) or "")
    return norm(m.group(1)), low.group(1) if low else None


def _compare(a: tuple, op: str, b: tuple) -> bool:
    return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}.get(op, True)


def wheel_fits(path: Path) -> bool:
    """A wheel file name's tags against this interpreter (CPython on Linux: the machine's arch)."""
    parts = path.name[:-4].split("-")
    abi, plat = parts[-2], parts[-1]
    if plat == "any":
        return True
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return sys.platform.startswith("linux") and platform.machine() in plat and abi in (here, "abi3")


def shipped(wheels: Path) -> dict[str, tuple[str, Path, list[str]]]:
    """{name: (version, wheel, Requires-Dist lines)} of the shipped wheels that fit this interpreter."""
    out = {}
    for w in sorted(wheels.glob("*.whl")):
        if not wheel_fits(w):
            continue
        with zipfile.ZipFile(w) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            text = z.read(meta).decode()
        name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
        version = re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
        out[norm(name)] = (version, w, re.findall(r"^Requires-Dist: (.+)$", text, re.M))
    return out


def installed(name: str, paths: list[str]) -> str | None:
    try:
        return next(md.distributions(name=name, path=paths + sys.path)).version
    except StopIteration:
        return None


def plan(needed: list[str], ships: dict, target: Path) -> tuple[list[Path], list[str]]:
    """(wheels to unpack, requirements nothing satisfies): the needed packages and, for each wheel to
    unpack, its own requirements, checked against this interpreter and `target` (earlier unpacks)."""
    todo, missing, seen = [], [], set()
    queue = [r for r in (parse_req(x) for x in needed) if r]
    while queue:
        name, low = queue.pop(0)
        if name in seen:
            continue
        seen.add(name)
        have = installed(name, [str(target)])
        if have is not None and (low is None or version_tuple(have) >= version_tuple(low)):
            continue
        if name in ships and (low is None or version_tuple(ships[name][0]) >= version_tuple(low)):
            todo.append(ships[name][1])
            queue += [r for r in (parse_req(x) for x in ships[name][2]) if r]
            continue
        missing.append(f"{name}>={low}" if low else name + (f" (have {have})" if have else ""))
    return todo, missing


def ensure(target: Path, wheels: Path, quiet: bool = False) -> int:
    ships = shipped(wheels)
    todo, missing = plan(NEEDED, ships, target)
    if missing:
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        hint = (f"the shipped wheels are for CPython {SHIPPED_FOR}, this is {py}; " if py != SHIPPED_FOR else "")
        print(f"gpu_check: missing {', '.join(missing)} and no shipped wheel fits ({hint}install them, or run "
              f"`python scripts/gpu_deps.py --download` where a package registry is reachable)", file=sys.stderr)
        return 3
    target.mkdir(parents=True, exist_ok=True)
    for w in todo:          # a wheel is a zip of the files an installer would copy (pure or this ABI's)
        with zipfile.ZipFile(w) as z:
            z.extractall(target)
    if not quiet:
        _, gaps = plan(OPTIONAL, {}, target)
        names = ", ".join(w.name.split("-")[0] for w in todo)
        what = f"unpacked {len(todo)} shipped wheel(s) into {target}: {names}" if todo else "every dependency present"
        print(f"gpu_check deps: {what}" + (f" (optional, absent: {', '.join(gaps)})" if gaps else ""))
    return 0


def download(wheels: Path) -> int:
    wheels.mkdir(parents=True, exist_ok=True)
    tags = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    return subprocess.call([sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--implementation=cp",
                            f"--python-version={SHIPPED_FOR}", *tags, "-d", str(wheels), *DOWNLOAD])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, help="where missing packages are unpacked (put it on PYTHONPATH)")
    ap.add_argument("--wheels", type=Path, default=WHEELS, help="the shipped wheels (default: scripts/wheels)")
    ap.add_argument("--download", action="store_true", help="refresh the shipped wheels from a registry")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.download:
        return download(a.wheels)
    if a.target is None:
        ap.error("--target DIR is needed")
    return ensure(a.target.resolve(), a.wheels, a.quiet)


if __name__ == "__main__":
    sys.exit(main())
