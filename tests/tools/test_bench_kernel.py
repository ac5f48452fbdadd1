"""The kernel benchmark runs end to end on a tiny configuration and writes its table."""

from __future__ import annotations

import json

from chunkserve.tools.bench_kernel import main


def test_quick_bench_writes_table_with_consistent_outputs(tmp_path, capsys):
    rc = main(["--quick", "--batch", "2", "--heads", "2", "--head-dim", "64", "--repeats", "1", "--warmup", "0",
               "--copy-mib", "16", "--matmul-n", "256", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "kernel_cpu_torch_fp32_quick.json").read_text())
    rows = {(r["n_p"], r["n_s"]): r for r in data["rows"]}
    assert set(rows) == {(1024, 0), (1024, 512), (1024, 768), (1024, 1024), (4096, 4096)}
    for r in rows.values():
        assert r["tpp_us"] > 0 and r["paged_us"] > 0 and r["tpp_vs_paged_rel_diff"] < 1e-5
    full = rows[(4096, 4096)]
    assert full["runs"] == 1 and full["contiguous_runs"] == 1  # the shared prompt is read as one view
    assert full["paged_bytes"] > 1.9 * full["tpp_bytes"]
    assert data["machine"]["copy_bw"] > 0 and data["machine"]["matmul_flops"] > 0
    out = capsys.readouterr().out
    assert "TPP/paged" in out and "TPP/dense" in out
    for (n_p, n_s), r in rows.items():  # the headline never counts paged over a shared pool as non-sharing
        dense = min(r["naive_us"], r["sdpa_us"])
        assert r["speedup_vs_dense"] == dense / r["tpp_us"]
        unshared = [dense] + ([rows[(n_p, 0)]["paged_us"]] if (n_p, 0) in rows else [])
        assert r["speedup_vs_best"] == min(unshared) / r["tpp_us"], (n_p, n_s)
        assert r["best_nonsharing"] != "paged" or n_s == 0
