"""The CPU's native-bf16 detection and what `dtype=None` resolves to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunkserve.workers import device
from chunkserve.workers.engine import EngineConfig, EngineCore
from chunkserve.workers.weights import resolve_dtype

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f {extra}

processor\t: 1
model name\t: second CPU, not read
flags\t\t: fpu
"""


def _fake_cpu(monkeypatch: pytest.MonkeyPatch, flags: set[str], torch_says: bool = False) -> None:
    monkeypatch.setattr(device, "cpu_info", lambda path=device.CPUINFO: ("fake CPU", frozenset(flags)))
    monkeypatch.setattr(device, "_torch_cpu_checks", lambda: [lambda: torch_says])


@pytest.mark.parametrize(("flags", "native"), [
    ({"avx2", "avx512f", "avx512_bf16"}, True),
    ({"avx2", "amx_tile", "amx_bf16"}, True),
    ({"avx2", "avx512f", "avx512bw"}, False),  # AVX-512 without BF16: bf16 is emulated
    (set(), False),
])
def test_native_bf16_is_avx512_bf16_or_amx_bf16(flags: set[str], native: bool) -> None:
    assert device.cpu_has_native_bf16(flags) is native


def test_cpu_info_reads_name_and_flags_of_the_first_cpu(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO.format(extra="amx_bf16"))
    name, flags = device.cpu_info(str(path))
    assert name == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"avx2", "avx512f", "amx_bf16"} <= flags and "fpu" in flags
    assert device.cpu_info(str(tmp_path / "missing"))[1] == frozenset()


@pytest.mark.parametrize(("flags", "torch_says", "want"), [
    ({"avx2", "avx512_bf16"}, False, torch.bfloat16),
    ({"avx2", "amx_bf16"}, False, torch.bfloat16),
    ({"avx2"}, False, torch.float32),
    (set(), True, torch.bfloat16),  # no /proc/cpuinfo flags: torch's own probe decides
])
def test_dtype_none_on_cpu_is_bf16_only_with_native_bf16(monkeypatch: pytest.MonkeyPatch, flags: set[str],
                                                          torch_says: bool, want: torch.dtype) -> None:
    _fake_cpu(monkeypatch, flags, torch_says)
    assert device.default_dtype("cpu") == want
    assert resolve_dtype(None, "cpu") == want
    assert resolve_dtype("auto", "cpu") == want
    assert resolve_dtype("float32", "cpu") == torch.float32  # an explicit dtype always wins


def test_engine_default_dtype_follows_the_cpu_and_explicit_fp32_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cpu(monkeypatch, {"avx2", "avx512_bf16"})
    tiny = dict(model="random:tiny", chunk_size=16, num_kv_chunks=16)
    assert EngineCore(EngineConfig(**tiny)).model.dtype == torch.bfloat16
    assert EngineCore(EngineConfig(**tiny)).cache.k_pool.dtype == torch.bfloat16
    assert EngineCore(EngineConfig(dtype="float32", **tiny)).model.dtype == torch.float32
    _fake_cpu(monkeypatch, {"avx2"})
    assert EngineCore(EngineConfig(**tiny)).model.dtype == torch.float32


def test_the_real_probe_agrees_with_proc_cpuinfo_flags_when_present() -> None:
    flags = device.cpu_info()[1]
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this system")
    if device.BF16_FLAGS & flags:
        assert device.cpu_has_native_bf16()
    assert "native bf16" in device.describe_cpu()
