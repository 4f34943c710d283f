"""The platform layer on recorded and synthetic machine trees (tests/fixtures/platform)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpuserve.errors import ConfigError
from cpuserve.platform.machine import detect_machine
from cpuserve.platform.overrides import read_overrides
from cpuserve.platform.plan import GiB, plan_kernel, plan_memory, plan_threads
from cpuserve.platform.sysfs import format_cpulist, parse_cpulist

FIXTURES = Path(__file__).parent / "fixtures" / "platform"


def machine(name: str):
    return detect_machine(FIXTURES / name)


def threads(name: str, env: dict | None = None):
    m = machine(name)
    return plan_threads(m.cpu, m.resources, read_overrides(env or {}))


def test_cpulist_syntax():
    assert parse_cpulist("0-3,6,8-9\n") == [0, 1, 2, 3, 6, 8, 9]
    assert format_cpulist([9, 0, 1, 2, 3, 6, 8]) == "0-3,6,8-9"
    for bad in ("a-b", "3-1", "1,,x", "0-"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


def test_this_x86_machine_recorded():
    m = machine("x86_epyc_2core")
    assert m.cpu.arch == "x86_64" and "AMD EPYC" in m.cpu.model_name
    assert {"avx2", "fma", "f16c"} <= m.cpu.features
    assert m.cpu.ids == [0, 1] and not m.cpu.smt and not m.cpu.little
    assert m.resources.allowed_cpus == (0, 1) and m.resources.cpu_quota is None
    assert m.resources.cgroup_version == 1 and m.resources.mem_limit is None
    assert 23 * GiB < m.resources.mem_total < 24 * GiB
    plan = threads("x86_epyc_2core")
    assert plan.cpus == (0, 1) and plan.pinned
    # The recorded host exposes AVX-512 VNNI; the best variant it supports is chosen.
    assert plan_kernel(m.cpu, read_overrides({})).variant == "avx512_vnni"


def test_cix_p1_uses_exactly_the_eight_big_cores():
    m = machine("cix_p1")
    assert m.cpu.arch == "aarch64"
    assert {"asimd", "asimddp", "i8mm", "sve", "sve2", "bf16"} <= m.cpu.features
    assert sorted(m.cpu.little) == [2, 3, 4, 5] and "Cortex-A520" in m.cpu.little_reason
    plan = threads("cix_p1")
    assert plan.cpus == (0, 1, 6, 7, 8, 9, 10, 11) and plan.count == 8
    # SVE2 + I8MM: the NEON I8MM variant (SVE2 at 128 bits brings no wider dot products, plan.py).
    assert plan_kernel(m.cpu, read_overrides({})).variant == "neon_i8mm"


def test_cix_p1_without_part_numbers_falls_back_to_capacity(tmp_path):
    tree = tmp_path / "cix"
    shutil.copytree(FIXTURES / "cix_p1", tree)
    cpuinfo = tree / "proc" / "cpuinfo"
    cpuinfo.write_text("\n".join(line for line in cpuinfo.read_text().splitlines() if "CPU part" not in line))
    m = detect_machine(tree)
    assert sorted(m.cpu.little) == [2, 3, 4, 5] and "cpu_capacity" in m.cpu.little_reason
    for cid in range(12):
        (tree / f"sys/devices/system/cpu/cpu{cid}/cpu_capacity").unlink()
    m = detect_machine(tree)
    assert sorted(m.cpu.little) == [2, 3, 4, 5] and "cpuinfo_max_freq" in m.cpu.little_reason
    assert plan_threads(m.cpu, m.resources, read_overrides({})).cpus == (0, 1, 6, 7, 8, 9, 10, 11)


def test_arm_server_without_big_little():
    m = machine("arm_server_v1")
    assert not m.cpu.little and len(m.cpu.ids) == 64 and m.cpu.nodes == [0, 1]
    plan = threads("arm_server_v1")
    assert plan.cpus == tuple(range(32)) and "NUMA node 0" in plan.reason
    # sve + i8mm but no sve2: the NEON i8mm variant.
    assert plan_kernel(m.cpu, read_overrides({})).variant == "neon_i8mm"


def test_container_limited_to_two_cpus_and_4gib():
    m = machine("container_cgroup2")
    res = m.resources
    assert m.cpu.smt and len(m.cpu.physical_cores(m.cpu.ids)) == 8
    assert res.cgroup_version == 2 and res.cpu_quota == 2.0
    assert res.mem_limit == 4 * GiB and res.mem_total == 4 * GiB
    assert res.mem_available == 4 * GiB - 100 * 1024**2
    plan = threads("container_cgroup2")
    assert plan.cpus == (0, 1) and "cgroup CPU quota of 2 CPUs" in plan.reason
    mem = plan_memory(
        res,
        read_overrides({}),
        weights=GiB,
        kv_bytes_per_token=43008,
        model_max_len=4096,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        activation_bytes_per_token=100_000,
    )
    assert mem.kv_bytes == res.mem_available - GiB - mem.workspace - mem.margin
    assert mem.kv_tokens == mem.kv_bytes // 43008 and mem.longest_context == 4096


def test_kv_cache_is_never_a_fraction_of_total():
    """The reference refuses to start on 32 GiB when 0.92 x total is not free; we size from what is."""
    m = machine("cix_p1")
    mem = plan_memory(
        m.resources,
        read_overrides({}),
        weights=int(1.4 * GiB),
        kv_bytes_per_token=43008,
        model_max_len=131072,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        activation_bytes_per_token=100_000,
    )
    assert mem.kv_bytes > 20 * GiB and mem.kv_tokens > 500_000


@pytest.mark.parametrize(
    "env,message",
    [
        (
            {"VLLM_CPU_OMP_THREADS_BIND": "0-99"},
            "VLLM_CPU_OMP_THREADS_BIND=0-99: CPUs 2-99 are not available to this process (it may use 0-1)",
        ),
        ({"VLLM_CPU_OMP_THREADS_BIND": "zero"}, "expected a CPU list, 'auto' or 'nobind'"),
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}, "tensor-parallel ranks"),
        ({"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS='0': expected a whole number of threads >= 1"),
        ({"OMP_NUM_THREADS": "8"}, "OMP_NUM_THREADS=8 asks for 8 threads but this process may use 2 CPUs"),
        ({"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "2"}, "asks for more threads than"),
        ({"CPUSERVE_ISA": "neon_i8mm"}, "CPUSERVE_ISA=neon_i8mm: this CPU supports avx512_vnni, avx2, generic"),
        ({"CPUSERVE_ISA": "scalar"}, "choose one of those or reference"),
        ({"CPUSERVE_KERNEL_VARIANT": "avx2"}, "CPUSERVE_KERNEL_VARIANT was replaced by CPUSERVE_ISA"),
    ],
)
def test_bad_thread_and_kernel_overrides(env, message):
    m = machine("x86_epyc_2core")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        ov = read_overrides(env)
        plan_threads(m.cpu, m.resources, ov)
        plan_kernel(m.cpu, ov)


def test_isa_override_names_a_supported_variant_or_reference():
    m = machine("x86_epyc_2core")
    for isa in ("avx2", "generic", "reference"):
        plan = plan_kernel(m.cpu, read_overrides({"CPUSERVE_ISA": isa}))
        assert plan.variant == isa and plan.reason == f"CPUSERVE_ISA={isa}"


def test_avx_vnni_without_avx512_and_with_it():
    """Alder Lake / Zen 5 client style (AVX-VNNI, no AVX-512): avx_vnni; with AVX-512 too: avx512_vnni."""
    from dataclasses import replace

    m = machine("x86_epyc_2core")
    client = replace(m.cpu, features=frozenset({"avx2", "fma", "f16c", "avx_vnni"}))
    assert plan_kernel(client, read_overrides({})).variant == "avx_vnni"
    assert plan_kernel(client, read_overrides({})).supported == ("avx_vnni", "avx2", "generic")
    both = replace(m.cpu, features=m.cpu.features | {"avx_vnni"})
    assert plan_kernel(both, read_overrides({})).variant == "avx512_vnni"


def test_cpuserve_amx_is_an_on_off_switch_and_anything_else_stops_the_start():
    assert read_overrides({}).amx is None
    assert read_overrides({"CPUSERVE_AMX": "0"}).amx is False
    assert read_overrides({"CPUSERVE_AMX": "off"}).amx is False
    on = read_overrides({"CPUSERVE_AMX": "1"})
    assert on.amx is True and on.sources["amx"] == "CPUSERVE_AMX=1"
    with pytest.raises(ConfigError, match=r"CPUSERVE_AMX='maybe': expected 1 or 0 \(on or off\)"):
        read_overrides({"CPUSERVE_AMX": "maybe"})


def test_good_thread_overrides():
    assert threads("cix_p1", {"VLLM_CPU_OMP_THREADS_BIND": "0,1,6,7"}).cpus == (0, 1, 6, 7)
    assert threads("cix_p1", {"VLLM_CPU_OMP_THREADS_BIND": "0-11", "OMP_NUM_THREADS": "3"}).cpus == (0, 1, 2)
    nobind = threads("cix_p1", {"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert not nobind.pinned and nobind.count == 8
    assert threads("cix_p1", {"OMP_NUM_THREADS": "4"}).cpus == (0, 1, 6, 7)
    # More threads than big cores: the little cores are added last.
    assert threads("cix_p1", {"OMP_NUM_THREADS": "10"}).cpus == (0, 1, 6, 7, 8, 9, 10, 11, 2, 3)
    # cpuserve's own name wins over vLLM's.
    both = {"CPUSERVE_THREADS_BIND": "6-7", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert threads("cix_p1", both).cpus == (6, 7)


def test_reference_image_variables_are_accepted_as_not_needed():
    env = {
        "FLAGGEMS_VENDOR": "arm",
        "TRITON_CPU_BACKEND": "1",
        "VLLM_PLUGINS": "fl",
        "A720_CORES": "0,1",
        "TRITON_CACHE_DIR": "/root/x",
        "MKL_NUM_THREADS": "8",
    }
    ov = read_overrides(env)
    assert set(ov.not_needed) == {f"{k}={v}" for k, v in env.items()}


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf"])
def test_bad_kvcache_space(value):
    with pytest.raises(ConfigError, match=f"VLLM_CPU_KVCACHE_SPACE='{value}': expected the KV cache size in GiB"):
        read_overrides({"VLLM_CPU_KVCACHE_SPACE": value})


def test_kvcache_larger_than_memory_and_model_larger_than_memory():
    res = machine("container_cgroup2").resources
    common = dict(
        kv_bytes_per_token=43008,
        model_max_len=4096,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        activation_bytes_per_token=10_000,
    )
    ov = read_overrides({"VLLM_CPU_KVCACHE_SPACE": "16"})
    with pytest.raises(
        ConfigError,
        match=r"VLLM_CPU_KVCACHE_SPACE=16 asks for a 16\.00 GiB KV cache, but only "
        r"[0-9.]+ GiB is available after weights and workspace; ask for at most",
    ):
        plan_memory(res, ov, weights=GiB, **common)
    ok = plan_memory(res, read_overrides({"VLLM_CPU_KVCACHE_SPACE": "1.5"}), weights=GiB, **common)
    assert ok.kv_bytes == int(1.5 * GiB) and ok.reason == "VLLM_CPU_KVCACHE_SPACE=1.5"
    with pytest.raises(
        ConfigError,
        match=r"the model needs 5\.00 GiB for weights .* but 3\.90 GiB of memory is "
        r"available; use a smaller or quantized model",
    ):
        plan_memory(res, read_overrides({}), weights=5 * GiB, **common)


def test_doctor_report_on_container_with_bundled_model(smol_dir):
    from cpuserve.doctor import build_report, render_text

    report = build_report(machine("container_cgroup2"), {"FLAGGEMS_VENDOR": "arm"}, smol_dir)
    assert report["problems"] == []
    mem = report["decisions"]["memory"]
    # the activations' dtype is this host's choice (bfloat16 only with native bf16 dot products); the
    # cache holds bf16 either way (the checkpoint's dtype where auto computes in float32)
    assert report["model"]["compute_dtype"] in ("bfloat16", "float32")
    assert report["model"]["kv_cache_dtype"].startswith("bfloat16")
    elem = 2
    assert mem["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * elem  # layers x kv heads x head_dim x dtype, K and V
    assert report["model"]["parameters"] == 134_515_008
    text = render_text(report)
    for expected in (
        "threads      2, pinned to 0-1",
        "kernels      avx2",
        "LlamaForCausalLM, 30 layers",
        "FLAGGEMS_VENDOR=arm: not needed",
        "verdict        ready",
        "longest context 8192",
    ):
        assert expected in text


def test_doctor_cli_live(cache_dir, smol_dir):
    env = {"CPUSERVE_CACHE_DIR": str(cache_dir), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "cpuserve", "doctor", "--json"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["problems"] == [] and report["model"]["architecture"] == "LlamaForCausalLM"
    bad = subprocess.run(
        [sys.executable, "-m", "cpuserve", "doctor", "--no-model"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "VLLM_CPU_KVCACHE_SPACE": "abc"},
    )
    assert bad.returncode == 1 and "VLLM_CPU_KVCACHE_SPACE='abc'" in bad.stdout
    too_long = subprocess.run(
        [sys.executable, "-m", "cpuserve", "doctor", "--max-model-len", "100000"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert too_long.returncode == 1 and "longer than the model's 8192 positions" in too_long.stdout


def test_aarch64_under_qemu_user_takes_its_features_from_hwcap(monkeypatch):
    """qemu-user before 8.2 shows an aarch64 process the host's x86 /proc/cpuinfo: the features are
    then the emulated CPU's HWCAPs (what the native kernels read), not the host's flags."""
    import cpuserve.platform.cpu as cpu_mod
    from cpuserve.platform.sysfs import SystemFiles

    class LiveTree(SystemFiles):  # the recorded x86 tree, read as if it were this live machine's
        @property
        def live(self) -> bool:
            return True

    monkeypatch.setattr(cpu_mod.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cpu_mod, "_hwcap_features", lambda: {"asimd", "asimddp", "i8mm"})
    cpu = cpu_mod.detect_cpu(LiveTree(FIXTURES / "x86_epyc_2core"))
    assert (cpu.arch, cpu.features) == ("aarch64", frozenset({"asimd", "asimddp", "i8mm"}))
    assert cpu.model_name == "Arm CPU (features from HWCAP)"
    assert plan_kernel(cpu, read_overrides({})).variant == "neon_i8mm"
    monkeypatch.setattr(cpu_mod, "_hwcap_features", lambda: {"asimd"})
    assert plan_kernel(cpu_mod.detect_cpu(LiveTree(FIXTURES / "x86_epyc_2core")), read_overrides({})).variant == "neon"
