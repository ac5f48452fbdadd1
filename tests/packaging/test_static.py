"""Static checks in CI: the import contract (import-linter, `.importlinter`) and the type check (mypy,
`mypy.ini`), both run by `scripts/static_checks.sh` over the package as it is imported."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "static_checks.sh"


def _run(what: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), what], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "VPY": str(ROOT / ".venv" / "bin" / "python")})


def test_import_contract_is_kept() -> None:
    out = _run("imports", 600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "BROKEN" not in out.stdout and out.stdout.count("KEPT") >= 3


def test_import_linter_sees_the_mapped_packages(tmp_path: Path) -> None:
    """A contract that the code breaks (router imports workers) must be reported: the check is not vacuous."""
    subprocess.run(["bash", str(SCRIPT), "tree"], cwd=ROOT, check=True, timeout=120,
                   env={**os.environ, "VPY": str(ROOT / ".venv" / "bin" / "python")})
    cfg = tmp_path / "broken.ini"
    cfg.write_text("[importlinter]\nroot_package = chunkserve\n\n[importlinter:contract:c]\nname = probe\n"
                   "type = forbidden\nsource_modules =\n    chunkserve.router\nforbidden_modules =\n"
                   "    chunkserve.workers\n")
    exe = shutil.which("lint-imports", path=str(ROOT / ".venv" / "bin"))
    assert exe is not None
    out = subprocess.run([exe, "--no-cache", str(cfg)], cwd=ROOT / "build" / "static", capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "build" / "static")})
    assert out.returncode != 0 and "BROKEN" in out.stdout, out.stdout[-3000:]
    assert "chunkserve.router" in out.stdout and "chunkserve.workers" in out.stdout


@pytest.mark.slow
def test_type_check_passes() -> None:
    """mypy over the whole package at mypy.ini's strictness (a few minutes without its cache)."""
    out = _run("types", 1200)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "Success: no issues found" in out.stdout
