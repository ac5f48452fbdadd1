"""`chunkserve up --device {auto,cpu,cuda}` (issue 13): what the flag sets, without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chunkserve.tools.device_flag import apply_device
from chunkserve.tools.launcher import app_config, parse_args


def test_cuda_gives_each_worker_one_gpu_and_the_cuda_device() -> None:
    cfg = app_config(parse_args(["--device", "cuda", "--dtype", "bfloat16"]))
    assert cfg.worker_num_gpus == 1 and cfg.worker_engine().device == "cuda"
    assert cfg.worker_engine().dtype == "bfloat16"


def test_cpu_forces_the_cpu_even_over_a_gpu_config() -> None:
    base = {"worker_num_gpus": 1, "engine": {"device": "cuda"}}
    assert apply_device("cpu", base) == "cpu"
    assert base == {"worker_num_gpus": 0, "engine": {"device": "cpu"}}


@pytest.mark.parametrize(("sees_gpu", "device", "gpus"), [(True, "cuda", 1), (False, "cpu", 0)])
def test_auto_picks_cuda_exactly_when_torch_sees_a_gpu(sees_gpu: bool, device: str, gpus: int) -> None:
    base: dict = {}
    assert apply_device("auto", base, probe=lambda: sees_gpu) == device
    assert base["engine"]["device"] == device and base["worker_num_gpus"] == gpus


def test_auto_keeps_what_the_config_chose() -> None:
    base = {"engine": {"device": "cuda:1"}}
    assert apply_device("auto", base, probe=lambda: False) == "cuda:1" and base == {"engine": {"device": "cuda:1"}}


def test_an_unknown_device_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--device", "tpu"])


def test_the_launcher_resolves_auto_without_importing_torch() -> None:
    code = ("import sys; from chunkserve.tools.launcher import app_config, parse_args; "
            "app_config(parse_args(['--device', 'auto'])); sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
