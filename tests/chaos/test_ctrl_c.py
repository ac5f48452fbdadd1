"""Ctrl-C on `chunkserve up` under streaming load: SIGINT to the whole process group (what a terminal sends),
then every request that was in flight completes (the drain), and the launcher exits by itself; with either
front (Ray's proxy, or HAProxy before direct-ingress replicas)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from harness import StreamLoad, failures, stream_completion

from chunkserve.cluster.redis_server import (
    find_free_port as _free_port,  # outside Ray's and the kernel's ports
)

pytestmark = pytest.mark.slow

MODEL = "tiny-ctrl-c"
PROMPTS = [[(17 * k + 5 * i) % 250 + 1 for i in range(40)] for k in range(3)]


@pytest.mark.parametrize("front", ["ray", "haproxy"])
def test_ctrl_c_under_load_lets_every_in_flight_request_complete(tmp_path, front):
    http_port, grpc_port = _free_port(), _free_port()
    cfg = tmp_path / "app.yaml"
    cfg.write_text(f"model_name: {MODEL}\nworkers: 1\n")
    log = open(tmp_path / "up.log", "w+")  # noqa: SIM115 (read back below)
    cmd = [sys.executable, "-m", "chunkserve.cli", "up", "--front", front, "--model", "random:tiny", "--config", str(cfg),
           "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--num-cpus", "2", "--drain-grace", "30",
           "--engine", '{"chunk_size": 16, "num_kv_chunks": 640, "max_model_len": 2048}']
    env = {**os.environ, "RAY_ADDRESS": ""}  # a cluster of its own, never one left by another test
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while "chunkserve is up" not in (tmp_path / "up.log").read_text():
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "chunkserve up did not come up"
            time.sleep(1.0)
        base = f"http://127.0.0.1:{http_port}"
        warm = stream_completion(base, {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4,
                                        "temperature": 0.0}, 0, 120.0)
        assert warm.ok, warm
        # requests of about 2 s each, however fast this machine decodes (a 160-token stream took 0.15 s through
        # HAProxy on one machine and 1.3-1.5 s on another; a stream shorter than 0.4 s is never found mid-way)
        probe = stream_completion(base, {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 160,
                                         "temperature": 0.0}, 2, 120.0)
        assert probe.ok, probe
        max_tokens = min(2000, max(160, round(160 * 2.0 / max(probe.t_end - probe.t_start, 1e-3))))
        load = StreamLoad(base, MODEL, PROMPTS, clients=4, max_tokens=max_tokens).start()
        time.sleep(2.0)
        # the 4 clients' rounds can line up so that a fixed sleep lands just as a round starts (CI once saw no
        # request in flight): wait until one is 0.4-0.7 s into its stream, with ~0.6 s or more still to go
        load.wait_in_flight(0.4, 0.7)
        load._stop.set()  # no new requests from here on: only the in-flight ones must finish
        t_int = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole foreground group
        # sent during the drain: once the launcher has said so, requests until one is not served (the route's
        # removal reaches the proxy a moment after `serve.delete`; a request before that is still served)
        deadline = time.monotonic() + 30
        while "draining" not in (tmp_path / "up.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        while True:
            late = stream_completion(base, {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4,
                                            "temperature": 0.0}, 1, 30.0)
            if not late.ok or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        outs = load.stop()
        # in flight = sent at least 0.25 s before the Ctrl-C (so the proxy has it) and not done by then; a request
        # sent in the same instant as the signal may reach the proxy after the app's routes are gone (a 404)
        in_flight = [o for o in outs if o.t_start <= t_int - 0.25 and t_int <= o.t_end]
        rc = proc.wait(timeout=120)
        text = (tmp_path / "up.log").read_text()
        bad = failures(in_flight)
        last_end = max((o.t_end for o in in_flight), default=t_int)
        print(f"\n[chaos] Ctrl-C: in_flight={len(in_flight)}, failed={len(bad)}, sent={len(outs)}, "
              f"durations_s={sorted(round(o.t_end - o.t_start, 2) for o in outs)[-6:]}, "
              f"last_finished_after_s={last_end - t_int:.1f}, "
              f"exit_s={time.monotonic() - t_int:.1f}, rc={rc}, sent_during_drain={late.status or late.error}",
              flush=True)
        assert in_flight and not bad, [(o.status, o.error) for o in bad][:3]
        # a request sent during the drain is refused cleanly (503 JSON + Retry-After from the proxy's guard; with
        # HAProxy, from Ray's head proxy, its fallback), or finds the front already gone; never Ray's plain-text 404
        refused = late.status == 0 and "Connect" in str(late.error)
        assert late.clean_error or refused, (late.status, late.error)
        assert rc == 0 and "chunkserve stopped." in text and "draining" in text
    finally:
        if proc.poll() is None:  # a failed test still stops its Ray cluster and HAProxy (a kill would orphan them)
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()
