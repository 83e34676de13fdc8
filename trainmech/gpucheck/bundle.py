"""The carry bundle: the wheels the GPU machine lacks for the runtime, pinned, checked without a download.

    profiles/cuda-preinstalled.txt   what the GPU machine's image already has (names)
    profiles/cuda-bundle.txt         what travels: NAME==VERSION, one line each (`make gpu-bundle` downloads them);
                                     a line marked `# shadows` carries a newer copy of a preinstalled package

`needed()` walks the runtime requirements (pyproject's [project].dependencies) through the
installed packages' metadata, with markers evaluated for the GPU machine (CPython 3.12, Linux
x86-64), and stops at what the image has: the names the bundle must hold, no more, no fewer.
`python -m trainmech.gpucheck.bundle .whl` checks a downloaded bundle: every pin present once,
nothing else, wheels that install on that machine, and the total size.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from trainmech.results import REPO_ROOT

__all__ = [
    "PREINSTALLED",
    "BUNDLE",
    "MAX_BYTES",
    "TARGET",
    "GLIBC_MINOR",
    "target_tags",
    "canonical",
    "preinstalled",
    "pins",
    "shadows",
    "runtime_roots",
    "needed",
    "requirement_problems",
    "check_folder",
]

PREINSTALLED = REPO_ROOT / "profiles" / "cuda-preinstalled.txt"
BUNDLE = REPO_ROOT / "profiles" / "cuda-bundle.txt"
MAX_BYTES = 60 * 2**20
TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}
GLIBC_MINOR = 39  # the GPU image's glibc is recent: any manylinux_2_N up to this installs


def target_tags() -> set:
    """Wheel tags that install on CPython 3.12, glibc Linux x86-64."""
    from packaging import tags

    platforms = [f"manylinux_2_{n}_x86_64" for n in range(GLIBC_MINOR, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return {
        *tags.cpython_tags((3, 12), platforms=platforms),
        *tags.compatible_tags((3, 12), "cp312", platforms),
    }


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lines(path: Path) -> list[str]:
    return [
        line.split("#")[0].strip()
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.split("#")[0].strip()
    ]


def preinstalled(path: Path = PREINSTALLED) -> set[str]:
    return {canonical(line) for line in _lines(path)}


def pins(path: Path = BUNDLE) -> list[tuple[str, str]]:
    """(canonical name, version) per line of the bundle list, in order, duplicates kept (a check counts them)."""
    out = []
    for line in _lines(path):
        name, sep, version = line.partition("==")
        out.append((canonical(name), version.strip() if sep else ""))
    return out


def shadows(path: Path = BUNDLE) -> set[str]:
    """Bundle lines marked `# shadows`: packages the image has, carried newer because a pinned wheel needs
    a floor the image's copy may not reach (the target folder comes first on PYTHONPATH)."""
    return {
        canonical(line.split("==")[0])
        for line in path.read_text(encoding="utf-8").splitlines()
        if "==" in line.split("#")[0] and "# shadows" in line
    }


def runtime_roots(pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[str]:
    from packaging.requirements import Requirement

    deps = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    return [canonical(Requirement(d).name) for d in deps]


def needed(roots: list[str] | None = None, have: set[str] | None = None) -> tuple[dict[str, str], list[str]]:
    """(name -> the version installed here, names this environment cannot resolve) of every package the
    runtime needs on the GPU machine beyond what it has; the walk does not enter preinstalled packages."""
    from packaging.requirements import Requirement

    have = preinstalled() if have is None else have
    found, unresolved, stack = (
        {},
        [],
        [r for r in (runtime_roots() if roots is None else roots) if r not in have],
    )
    while stack:
        name = canonical(stack.pop())
        if name in found or name in unresolved or name in have:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            unresolved.append(name)
            continue
        found[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(TARGET):
                stack.append(req.name)
    return dict(sorted(found.items())), sorted(unresolved)


def requirement_problems(names: list[str] | None = None) -> list[str]:
    """Unmet requirements of the bundle's packages in this environment (pip check for the bundle alone):
    on the GPU machine, a preinstalled package too old for a wheel that needs it shows up here."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    problems = []
    for name in names if names is not None else [n for n, _ in pins()]:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed")
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate():
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{name} needs {req}, which is not installed")
                continue
            if not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{name} needs {req}, found {have}")
    return problems


def check_folder(folder: Path, pinned: list[tuple[str, str]] | None = None) -> list[str]:
    """Problems with a downloaded bundle (empty when it is right): pins missing, extra or doubled wheels,
    wheels that do not install on CPython 3.12 x86-64 Linux, and a total over MAX_BYTES."""
    pinned = pins() if pinned is None else pinned
    from packaging.utils import parse_wheel_filename

    wheels = sorted(Path(folder).glob("*.whl"))
    seen: dict[str, list[str]] = {}
    problems, installable = [], target_tags()
    for w in wheels:
        name, version, _, wheel_tags = parse_wheel_filename(w.name)
        seen.setdefault(canonical(name), []).append(str(version))
        if not wheel_tags & installable:
            problems.append(f"{w.name} does not install on CPython 3.12, Linux x86-64")
    for name, version in pinned:
        got = seen.get(name, [])
        if got != [version]:
            problems.append(f"{name}=={version}: found {', '.join(got) or 'nothing'}")
    extra = sorted(set(seen) - {n for n, _ in pinned})
    problems += [f"{n} is not in {BUNDLE.name}" for n in extra]
    total = sum(w.stat().st_size for w in wheels)
    if total > MAX_BYTES:
        problems.append(f"the bundle holds {total / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    return problems


if __name__ == "__main__":  # python -m trainmech.gpucheck.bundle FOLDER
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else REPO_ROOT / ".whl")
    issues = check_folder(folder)
    size = sum(w.stat().st_size for w in folder.glob("*.whl"))
    for line in issues:
        print(f"gpu-bundle: {line}", file=sys.stderr)
    print(
        f"gpu-bundle: {len(list(folder.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {folder}: {'ok' if not issues else 'NOT ok'}"
    )
    sys.exit(1 if issues else 0)
