"""Facts about where a bench ran: host, GPU, versions, git commit."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def gpu(index: int) -> dict | None:
    """Name, memory and driver of a GPU, from nvidia-smi; None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    line = _run(["nvidia-smi", "-i", str(index), "--query-gpu=name,memory.total,driver_version",
                 "--format=csv,noheader,nounits"])
    if not line:
        return None
    name, memory_mib, driver = (s.strip() for s in line.split(",")[:3])
    return {"name": name, "memory_bytes": int(memory_mib) << 20, "driver": driver}


def host() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def git(where: Path) -> dict | None:
    """Commit of the checkout at `where`, and whether tracked files differ from it. A copy
    of the tree on a GPU machine names its commit in LILY_GIT_COMMIT, which wins (the .git
    that travels with such a copy may be older than its files); the checkout's own HEAD is
    then kept beside it, so a stale export can be seen for what it is."""
    commit = _run(["git", "rev-parse", "HEAD"], where)
    dirty = bool(_run(["git", "status", "--porcelain", "--untracked-files=no"], where)) if commit else False
    given = os.environ.get("LILY_GIT_COMMIT")
    if given:
        return {"commit": given, "dirty": False, "where": "LILY_GIT_COMMIT", "checkout": commit, "checkout_dirty": dirty}
    if commit is None:
        return None
    return {"commit": commit, "dirty": dirty, "where": str(where)}
