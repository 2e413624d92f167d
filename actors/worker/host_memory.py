"""How much more memory this process may take: a KV pool on CPU is checked against it.

A pool larger than that does not fail where it is sized: the allocation may succeed
(Linux overcommits) and the kernel's OOM killer then ends the process, or another one,
when zeroing it touches the pages. So the worker refuses it at start, naming the setting.

`available_bytes()` is the lower of `/proc/meminfo`'s MemAvailable and, for the process's
cgroup and each ancestor with a memory limit, that limit less the cgroup's working set
(its usage less its inactive file pages, as the kubelet counts it): in a Kubernetes pod
(or a Slurm job, a systemd slice) the limit, not the host's memory, is what the OOM
killer enforces. None where neither can be read (not
Linux): no check.

Pure: the standard library only.
"""

from __future__ import annotations

from pathlib import Path

NO_LIMIT = 1 << 60
"""cgroup v1 writes "no limit" as a number near 2**63; anything above this is none."""


def available_bytes(root: Path = Path("/")) -> tuple[int, str] | None:
    """(bytes this process may still take, where that figure comes from), or None.
    `root` is the file system's root (tests point it at a folder of fake files)."""
    found: list[tuple[int, str]] = []
    meminfo = _meminfo(root / "proc" / "meminfo")
    if meminfo is not None:
        found.append((meminfo, "MemAvailable in /proc/meminfo"))
    cgroup = _cgroup_room(root)
    if cgroup is not None:
        found.append(cgroup)
    return min(found) if found else None


def _meminfo(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_room(root: Path) -> tuple[int, str] | None:
    """The least room (limit less working set) over the process's cgroup and every
    ancestor that has a memory limit, for v2 or v1; None where none has one. An
    ancestor's limit binds too: Slurm limits the job, not its task's leaf, and a
    systemd slice its units."""
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base = root / "sys" / "fs" / "cgroup"
            names = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = root / "sys" / "fs" / "cgroup" / "memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [part for part in rel.split("/") if part]
        # Inside a container its own cgroup is the mounted hierarchy's root, and the
        # path /proc names is not under it: then the root alone.
        leaf = base.joinpath(*parts)
        levels = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
        if not (leaf / names[0]).is_file():
            levels = [base]
        for folder in levels:
            limit = _read_int(folder / names[0])
            if names[0] == "memory.limit_in_bytes":  # v1: the ancestors' limits, in one
                hierarchical = _stat(folder / "memory.stat", "hierarchical_memory_limit")
                if hierarchical and (limit is None or hierarchical < limit):
                    limit = hierarchical
            usage = _read_int(folder / names[1])
            if limit is None or limit >= NO_LIMIT or usage is None:
                continue
            inactive = _stat(folder / "memory.stat", names[2])
            room = max(0, limit - max(0, usage - inactive))
            if best is None or room < best[0]:
                best = (
                    room,
                    f"the cgroup's memory limit less its working set ({folder / names[0]})",
                )
    return best
