"""The built wheel installs the chunkserve namespace (and no bare top-level modules)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True, text=True)
    (whl,) = out.glob("chunkserve-*.whl")
    return whl


def test_wheel_holds_only_the_chunkserve_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"chunkserve"}
    for sub in ("kernels", "workers", "cluster", "router", "v1"):
        assert f"chunkserve/{sub}/__init__.py" in names
    assert "chunkserve/v1/generate.proto" in names
    assert "chunkserve/kernels/tpp_torch.py" in names
    for src in ("decode_cpu.cpp", "run_cpu.cpp", "simd.h"):  # the CPU kernels are built from them on first use
        assert f"chunkserve/kernels/csrc/{src}" in names
    for src in ("qmatmul.cpp", "qact.h", "glue.cpp"):  # the int4/int8 matmul and the dense glue, built the same way
        assert f"chunkserve/workers/csrc/{src}" in names
    assert {"chunkserve/loadtests/locustfile.py", "chunkserve/loadtests/workload.py"} <= set(names)
    assert {f"chunkserve/router/static/dashboard.{ext}" for ext in ("html", "js", "css")} <= set(names)


def test_modules_import_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    code = (
        "import chunkserve.kernels as k, chunkserve.workers.kvcache as c, chunkserve.cluster.hashing, "
        "chunkserve.router.policy, chunkserve.cli;"
        "import importlib.util as u;"
        f"assert k.__file__.startswith({str(target)!r}), k.__file__;"
        # none of the bare names comes from the wheel (PyPI's own `kernels`, a transformers dependency, may be installed)
        f"found = [(m, s.origin) for m in ('kernels', 'workers', 'router', 'cluster', 'loadtests') "
        f"for s in [u.find_spec(m)] if s is not None and {str(target)!r} in str(s.origin or s.submodule_search_locations)];"
        "assert not found, found;"
        "from chunkserve.tools.loadtest import LOCUSTFILE;"
        f"assert LOCUSTFILE.is_file() and str(LOCUSTFILE).startswith({str(target)!r}), LOCUSTFILE;"
        "print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
