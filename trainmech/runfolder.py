"""The results folder of one run label: its lock, its staging folder and its replacement as a whole.

    with label_lock(root, label):                   # a second run of the label is refused meanwhile
        remove_stale(root, label)                   # staging left by runs that were killed
        new_staging(staging)                        # results/.staging-<label>-<pid>/
        ...                                         # the run builds everything there
        replace_dir(staging, root / label)          # the old folder is swapped out whole, never half

Only the run that holds a label's lock touches `results/<label>/`, `results/<label>.partial/` or
the label's staging folders. A staging folder whose process is gone (a SIGKILLed run) is removed
when the label is next run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from trainmech import results
from trainmech.errors import TrainmechError

__all__ = [
    "RUN_FILES",
    "MAX_RUN_JSON_BYTES",
    "label_lock",
    "remove_stale",
    "new_staging",
    "check_target",
    "replace_dir",
    "read_run_json",
    "write_json",
]

RUN_FILES = {
    "run.json",
    "REGISTRY.md",
    "notebooks",
    "checks",
}  # besides record files: what a run writes into its folder
MAX_RUN_JSON_BYTES = 4 << 20


@contextlib.contextmanager
def label_lock(root: Path, label: str):
    """Hold results/.lock-<label> (fcntl.flock) while inside; refused at once when another process holds it."""
    path = root / f".lock-{label}"
    while True:
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise TrainmechError(f"cannot write into {root} ({e.strerror}); no notebook was run") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise TrainmechError(
                f"another run of label {label!r} is in progress (pid {holder}); wait for it to end or choose another --label"
            ) from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break  # the file we locked is still the lock (its previous holder did not just remove it)
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(root: Path, label: str) -> list[str]:
    """Remove the label's staging and set-aside folders left by processes that no longer exist."""
    pattern = re.compile(rf"^\.(?:staging|old)-{re.escape(label)}-(\d+)\Z")
    removed = []
    for p in root.iterdir():
        m = pattern.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed


def new_staging(staging: Path) -> None:
    """An empty staging folder (results/.staging-<label>-<pid>: remove_stale knows it by that name)."""
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()


def check_target(target: Path) -> None:
    """results/<label> may be absent or a folder a run (or a notebook's records) made; nothing else is replaced."""
    if not os.path.lexists(target):
        return
    if target.is_symlink() or not target.is_dir():
        raise TrainmechError(f"results/{target.name} exists and is not a run folder; choose another --label")
    foreign = sorted(
        p.name
        for p in target.iterdir()
        if p.name not in RUN_FILES
        and not (p.name.endswith(".json") and "__" in p.name)
        and not p.name.startswith(".tmp-")
    )
    if foreign:
        raise TrainmechError(
            f"results/{target.name} holds files a run does not write ({', '.join(foreign[:3])}); "
            "move them away or choose another --label"
        )


def replace_dir(staging: Path, target: Path) -> None:
    """Swap staging into target as a whole: the old folder is moved aside, then removed."""
    old = target.with_name(f".old-{target.name}-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    try:
        staging.rename(target)
    except OSError:
        if old.exists():
            old.rename(target)  # put the previous results back: never half of each
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_run_json(folder: Path) -> dict[str, Any] | None:
    """A run folder's run.json, or None when absent; refused in one sentence when unreadable."""
    path = folder / "run.json"
    if not os.path.lexists(path):
        return None
    data = results.read_json(path, "run summary", MAX_RUN_JSON_BYTES, f"results/{folder.name}/run.json")
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("notebooks"), list)
        or not all(isinstance(n, dict) and isinstance(n.get("notebook"), str) for n in data["notebooks"])
    ):
        raise TrainmechError(f"results/{folder.name}/run.json is not a run summary (no list of notebooks)")
    return data


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
