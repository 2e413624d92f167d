"""The CPU KV pool is checked against the memory the process may still take."""

from __future__ import annotations

from pathlib import Path

import pytest

from spur.actors.worker.host_memory import available_bytes

GIB = 1 << 30


def fake_root(
    tmp_path: Path, cgroup: str, files: dict[str, str], available_kb: int | None = 8 * GIB // 1024
) -> Path:
    """A folder standing for `/`: /proc/meminfo, /proc/self/cgroup and cgroup files."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    if available_kb is not None:
        (tmp_path / "proc" / "meminfo").write_text(
            f"MemTotal:       33554432 kB\nMemAvailable:   {available_kb} kB\n"
        )
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = tmp_path / "sys" / "fs" / "cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_meminfo_alone_without_a_cgroup_limit(tmp_path):
    root = fake_root(tmp_path, "0::/\n", {"memory.max": "max\n", "memory.current": "123\n"})
    assert available_bytes(root) == (8 * GIB, "MemAvailable in /proc/meminfo")


def test_a_cgroup_v2_limit_less_its_working_set_when_lower(tmp_path):
    """A pod limited to 4 GiB using 3 GiB, 1 GiB of it inactive page cache: 2 GiB left."""
    root = fake_root(
        tmp_path,
        "0::/kubepods/pod1\n",
        {
            "kubepods/pod1/memory.max": f"{4 * GIB}\n",
            "kubepods/pod1/memory.current": f"{3 * GIB}\n",
            "kubepods/pod1/memory.stat": f"anon 123\ninactive_file {GIB}\n",
        },
    )
    room, source = available_bytes(root)
    assert room == 2 * GIB
    assert "cgroup's memory limit" in source and "kubepods/pod1/memory.max" in source


def test_a_cgroup_v1_limit_at_the_namespace_root(tmp_path):
    """In a container the cgroup path of /proc/self/cgroup is not under the mounted
    hierarchy: the hierarchy's root is the container's own cgroup."""
    root = fake_root(
        tmp_path,
        "0::/\n9:memory:/docker/abc\n",
        {
            "memory/memory.limit_in_bytes": f"{6 * GIB}\n",
            "memory/memory.usage_in_bytes": f"{GIB}\n",
            "memory/memory.stat": "total_inactive_file 0\n",
        },
    )
    assert available_bytes(root)[0] == 5 * GIB


def test_cgroup_v1_without_a_limit_and_nothing_readable(tmp_path):
    root = fake_root(
        tmp_path,
        "9:memory:/\n",
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": "1",
        },
    )
    assert available_bytes(root)[0] == 8 * GIB
    assert available_bytes(tmp_path / "nothing") is None


def test_a_pool_larger_than_the_memory_left_is_refused_at_start(tiny_model_dir):
    """Allocated anyway, the pool would be zeroed page by page until the OOM killer
    ends the process (or another one): the engine refuses it, naming the settings."""
    from spur.actors.llm import LLM

    with pytest.raises(ValueError, match=r"more than the memory this process may still take") as e:
        LLM(str(tiny_model_dir("llama")), num_kv_blocks=10**8, block_size=256)
    assert "engine.kv_cache_bytes or engine.num_kv_blocks lower" in str(e.value)


def test_an_ancestors_limit_binds_too(tmp_path):
    """Slurm limits the job, not its task's leaf (v2); a v1 leaf reports its ancestors'
    limit as hierarchical_memory_limit."""
    limited = {
        "job_1/memory.max": f"{4 * GIB}",
        "job_1/memory.current": f"{3 * GIB}",
        "job_1/memory.stat": "inactive_file 0\n",
        "job_1/step_0/memory.max": "max",
        "job_1/step_0/memory.current": f"{3 * GIB}",
        "job_1/step_0/task_0/memory.max": "max",
        "job_1/step_0/task_0/memory.current": f"{3 * GIB}",
    }
    room, source = available_bytes(fake_root(tmp_path / "v2", "0::/job_1/step_0/task_0\n", limited))
    assert room == GIB and "job_1/memory.max" in source
    v1 = {
        "memory/parent/memory.limit_in_bytes": f"{4 * GIB}",
        "memory/parent/memory.usage_in_bytes": f"{3 * GIB}",
        "memory/parent/child/memory.limit_in_bytes": "9223372036854771712",
        "memory/parent/child/memory.usage_in_bytes": f"{3 * GIB}",
        "memory/parent/child/memory.stat": f"hierarchical_memory_limit {4 * GIB}\n",
    }
    assert available_bytes(fake_root(tmp_path / "v1", "4:memory:/parent/child\n", v1))[0] == GIB


def test_the_ranks_of_one_engine_count_together():
    """Tensor-parallel ranks share their engine's host and check at the same time:
    each counts every rank's pool, or two pools of 3/4 of the memory would pass."""
    from spur.actors.worker.worker import _check_host_memory

    found = available_bytes()
    if found is None:
        pytest.skip("this host says nothing of its memory")
    size = found[0] * 3 // 4
    _check_host_memory(100, size, ranks=1)
    with pytest.raises(ValueError, match=r"2 ranks' KV pools of 100 blocks each .* are more"):
        _check_host_memory(100, size, ranks=2)
