"""`chunkserve bench serve` end to end against the project's own OpenAI server (`LocalServer` over a real
in-process engine with a tiny random-weight Llama), plus its flag checks, a launched server's lifecycle and
the target arithmetic."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkserve.cluster.redis_server import (
    find_free_port as _free_port,  # outside Ray's and the kernel's ports
)
from chunkserve.router.local_server import LocalServer, local_ingress
from chunkserve.tools import bench_serve, report
from chunkserve.tools.client import RequestRecord, percentile, summarize
from chunkserve.tools.workload import (
    WorkloadSpec,
    arrivals,
    chat_requests,
    embedded_tokenizer_json,
    load_counter,
)
from chunkserve.workers.engine import EngineConfig

CHUNK = 16


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    cfg = EngineConfig(model="random:tiny", chunk_size=CHUNK, num_kv_chunks=256, max_model_len=512, max_num_seqs=8)
    with LocalServer(lambda: local_ingress(cfg, model_name="tiny-bench"), grpc_port=None) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer() -> str:
    """The embedded model's tokenizer.json, found once (a child process that imports torch)."""
    return str(embedded_tokenizer_json())


def test_bench_serve_reports_throughput_latency_and_cached_tokens(server: LocalServer, tokenizer: str,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    rc = bench_serve.main(["--tokenizer", tokenizer, "--endpoint", f"local={server.http_url}/v1", "--tenants", "2", "--requests-per-tenant",
                           "2", "--system-tokens", "40", "--max-tokens", "3", "--passes", "2", "--single", "1",
                           "--engine-clock-wait", "0.3", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["workload"]["requests"] == 4 and res["workload"]["system_prompt_tokens"] >= 40
    ep = res["endpoints"]["local"]
    assert ep["model"] == "tiny-bench" and set(ep["runs"]) == {"pass1", "pass2", "single"}
    first, again, single = ep["runs"]["pass1"], ep["runs"]["pass2"], ep["runs"]["single"]
    for run, n in ((first, 4), (again, 4), (single, 1)):
        assert run["requests"] == n and run["failed"] == 0 and run["usage_reported"]
        assert n <= run["completion_tokens"] <= 3 * n
        # wall_s is rounded to the ms: a run of a few ms on a fast CPU moves the quotient by more than 1%
        rel = max(0.01, 0.0006 / run["wall_s"])
        assert run["completion_tok_per_s"] == pytest.approx(run["completion_tokens"] / run["wall_s"], rel=rel)
        ttft = run["ttft_ms"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"] <= run["e2e_ms"]["p99"] + 1e-6
    assert first["prompt_tokens"] > 4 * 40
    # the second pass repeats the system prompts: their full chunks come from the cache
    assert again["cached_tokens"] > first["cached_tokens"]
    assert again["cached_fraction"] >= 0.5
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    # the engine thread's step clock from the endpoint's /metrics: the first pass prefilled 4 prompts
    clock = first["engine_clock"]
    assert clock["busy_s"] > 0 and 0 < clock["cpu_s"] <= clock["busy_s"] + 0.01 and clock["runqueue_s"] >= 0
    assert "engine threads" in report.engine_table(res)


def test_ignore_eos_is_sent_to_every_endpoint_and_recorded(server: LocalServer, tokenizer: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    real = server.ingress._sampling

    def spy(req, n_prompt):
        params = real(req, n_prompt)
        seen.append(params.ignore_eos)
        return params

    monkeypatch.setattr(server.ingress, "_sampling", spy)
    out = tmp_path / "eos.json"
    argv = ["--tokenizer", tokenizer, "--endpoint", f"local={server.http_url}/v1", "--tenants", "1",
            "--requests-per-tenant", "2", "--system-tokens", "20", "--max-tokens", "3", "--passes", "1",
            "--single", "0", "--engine-clock-wait", "0", "--no-plot", "--json", str(out)]
    assert bench_serve.main([*argv, "--ignore-eos"]) == 0
    # the two chats carry it (a warm-up request before them may not)
    assert seen.count(True) == 2 and json.loads(out.read_text())["ignore_eos"] is True
    seen.clear()
    assert bench_serve.main(argv) == 0
    assert len(seen) >= 2 and True not in seen and json.loads(out.read_text())["ignore_eos"] is False


@pytest.mark.parametrize("argv, message", [
    (["--endpoint", "localhost:8000"], "must start with http"),
    (["--endpoint", "a=http://x", "--launch", "b=true"], "not endpoints"),
    (["--endpoint", "a=http://x", "--vs", "a,b"], "two of the endpoints"),
    (["--endpoint", "a=http://x", "--rate", "0"], "arrival rate"),
    (["--endpoint", "a=http://x", "--extra-body", "a=[1]"], "JSON object"),
    (["--endpoint", "a=http://x", "--engine-clock-wait", "-1"], "engine-clock-wait"),
    (["--endpoint", "a=http://x", "--max-concurrency", "-1"], "max-concurrency"),  # was found after launching
])
def test_bench_serve_rejects_bad_flags_with_a_usage_error(argv: list[str], message: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench_serve.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("fault", ["refused", "dropped"])
def test_unreachable_endpoint_is_reported_not_raised(fault: str, tokenizer: str, tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if fault == "dropped":  # accepts, then closes every connection without a byte
            listener.listen()
            threading.Thread(target=_drop_all, args=(listener,), daemon=True).start()
        else:
            listener.close()
        out = tmp_path / "down.json"
        rc = bench_serve.main(["--tokenizer", tokenizer, "--endpoint", f"down=http://127.0.0.1:{port}",
                               "--model", "down=m", "--passes", "1", "--single", "0", "--tenants", "1", "--requests-per-tenant", "1",
                               "--system-tokens", "10", "--json", str(out), "--no-plot"])
    assert rc == 1
    ep = json.loads(out.read_text())["endpoints"]["down"]
    assert ep["runs"] == {}
    assert "warm-up request failed" in ep["error"]
    # refused: "Cannot connect"; dropped: a reset or a disconnect, depending on when the close lands
    words = ("connect",) if fault == "refused" else ("clientoserror", "serverdisconnectederror")
    assert any(w in ep["error"].lower() for w in words)


def _drop_all(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.close()


def test_launched_server_is_started_for_its_runs_and_stopped_after(tokenizer: str, tmp_path: Path) -> None:
    # a real HTTP server that lists models (a static file) but cannot serve chats: ready, then a warm-up error
    (tmp_path / "www" / "v1").mkdir(parents=True)
    (tmp_path / "www" / "v1" / "models").write_text(json.dumps({"data": [{"id": "m"}]}))
    port = _free_port()
    cmd = f"{sys.executable} -m http.server {port} --bind 127.0.0.1 --directory {tmp_path / 'www'}"
    out = tmp_path / "launched.json"
    rc = bench_serve.main(["--tokenizer", tokenizer, "--endpoint", f"static=http://127.0.0.1:{port}", "--launch", f"static={cmd}",
                           "--passes", "1", "--system-tokens", "10", "--json", str(out), "--no-plot"])
    assert rc == 1
    ep = json.loads(out.read_text())["endpoints"]["static"]
    assert "warm-up request failed" in ep["error"] and "HTTP 501" in ep["error"]
    with socket.socket() as s:  # stopped: nothing listens on its port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
    rc = bench_serve.main(["--tokenizer", tokenizer, "--endpoint", "gone=http://127.0.0.1:9", "--launch", "gone=sh -c 'exit 3'", "--json", str(out),
                           "--system-tokens", "10", "--no-plot"])
    assert rc == 1
    assert "exited with 3 before serving" in json.loads(out.read_text())["endpoints"]["gone"]["error"]


def test_engine_clock_sums_the_workers_and_a_server_without_it_reads_none() -> None:
    from chunkserve.tools import engine_clock

    text = ("# HELP x\n"
            'chunkserve:worker_engine_step_seconds_total{model_name="m",worker_id="a"} 2.5\n'
            'chunkserve:worker_engine_step_seconds_total{model_name="m",worker_id="b"} 1.5\n'
            'chunkserve:worker_engine_step_cpu_seconds_total{model_name="m",worker_id="a"} 3\n'
            'chunkserve:worker_engine_step_runqueue_seconds_total{model_name="m",worker_id="a"} 0.5\n'
            "chunkserve:worker_engine_step_seconds_total_other 9\n")
    before = engine_clock.parse(text)
    assert before == {"busy_s": 4.0, "cpu_s": 3.0, "runqueue_s": 0.5}
    assert engine_clock.parse("llamacpp:prompt_tokens_total 5\n") is None
    d = engine_clock.delta(before, {"busy_s": 8.0, "cpu_s": 6.0, "runqueue_s": 1.5})
    assert d == {"busy_s": 4.0, "cpu_s": 3.0, "runqueue_s": 1.0, "runqueue_share": 0.25}
    assert engine_clock.delta(before, {"busy_s": 1.0, "cpu_s": 6.0, "runqueue_s": 1.5}) is None  # a restart
    assert engine_clock.delta(before, None) is None


def test_summary_figures_follow_from_the_request_records() -> None:
    recs = [RequestRecord("a", start=0.0, first=0.5, end=2.5, completion_tokens=5, prompt_tokens=100,
                          cached_tokens=64, events=5, usage_reported=True),
            RequestRecord("b", start=0.0, first=1.5, end=4.0, completion_tokens=6, prompt_tokens=100,
                          cached_tokens=0, events=2, usage_reported=True),
            RequestRecord("c", start=0.0, error="HTTP 429: slow down")]
    s = summarize(recs)
    assert (s["requests"], s["failed"], s["errors"]) == (3, 1, ["HTTP 429: slow down"])
    assert s["completion_tok_per_s"] == pytest.approx(11 / 4.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(1000.0) and s["ttft_ms"]["p99"] == pytest.approx(1490.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(500.0)  # 2 s / 4 and 2.5 s / 5
    assert (s["cached_tokens"], s["cached_fraction"]) == (64, 0.32)
    assert s["by_tenant"] == {"a": {"ttft_s": [0.5], "cached_tokens": 64},  # failed requests are left out
                              "b": {"ttft_s": [1.5], "cached_tokens": 0}}
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0], 99) == 1.0


def test_poisson_arrivals_and_workload_shape(tokenizer: str) -> None:
    times = arrivals(2000, rate=4.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)
    count = load_counter(tokenizer)
    reqs = chat_requests(WorkloadSpec(tenants=3, requests_per_tenant=9, system_tokens=60, prompt_salt="s1"), count)
    assert len(reqs) == 27 and len({r.messages[0]["content"] for r in reqs}) == 3
    assert len({r.messages[1]["content"] for r in reqs}) == 9  # questions past the 8 built-in ones stay distinct
    assert all(60 <= count(r.messages[0]["content"]) < 120 and "s1" in r.messages[0]["content"] for r in reqs)


def test_targets_compare_ours_against_the_peer() -> None:
    def run(tok_s: float, ttft: float, dec: float | None = None) -> dict:
        return {"completion_tok_per_s": tok_s, "ttft_ms": {"p50": ttft}, "decode_tok_per_s": dec}

    res = {"endpoints": {
        "us": {"runs": {"pass1": run(80, 1000), "pass2": run(100, 900), "single": run(10, 50, 20)}},
        "peer": {"runs": {"pass1": run(9, 20000), "pass2": run(80, 1000)}}}}
    rows = {r["target"]: r for r in report.check_targets(res, "us", "peer")}
    assert [r["verdict"] for r in rows.values()] == ["PASS", "PASS", "FAIL", "PASS", "MISSING"]
    assert rows["first time: TTFT p50 <= 1/15"]["ratio"] == pytest.approx(0.05)
    assert "MISSING" in report.targets_table(list(rows.values()), "us", "peer")


def test_bench_serve_never_imports_torch() -> None:
    code = ("import sys, chunkserve.tools.bench_serve, chunkserve.tools.report, chunkserve.tools.procs; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=300).returncode == 0
