"""`chunkserve up`'s flags become one `AppConfig` plus `LaunchOptions`; a bad field stops it before Ray starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkserve.tools import launcher

ROOT = Path(__file__).resolve().parents[2]


def test_flags_on_top_of_a_serve_config_file_give_one_app_config() -> None:
    args = launcher.parse_args(["--config", str(ROOT / "deploy" / "local.yaml"), "--workers", "3",
                                "--engine", '{"chunk_size": 32}', "--dtype", "float32", "--num-cpus", "4",
                                "--http-port", "8123"])
    cfg = launcher.app_config(args)
    assert cfg.workers == 3 and cfg.node_cpus == 4 and cfg.redis_url is None
    assert (cfg.engine.chunk_size, cfg.engine.dtype, cfg.engine.kv_cache_gb) == (32, "float32", 1.0)  # YAML kept
    opts = launcher.launch_options(args)
    # the flag wins; the rest comes from the file's own Serve settings (they were ignored)
    assert (opts.http_port, opts.grpc_port, opts.num_cpus, opts.proxy_location) == (8123, 9000, 4, "HeadOnly")
    assert opts.env_vars["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"


def test_the_config_files_redis_url_is_kept_and_workers_flag_replaces_its_autoscaling(tmp_path: Path) -> None:
    """The file's redis_url was dropped (a private Redis started instead), and --workers was ignored beside the
    file's autoscaling."""
    path = tmp_path / "app.yaml"
    path.write_text("redis_url: redis://10.0.0.5:6379/0\nautoscaling: {min_replicas: 1, max_replicas: 8}\n")
    cfg = launcher.app_config(launcher.parse_args(["--config", str(path)]))
    assert cfg.redis_url == "redis://10.0.0.5:6379/0" and cfg.autoscaling == {"min_replicas": 1, "max_replicas": 8}
    cfg = launcher.app_config(launcher.parse_args(["--config", str(path), "--workers", "4",
                                                   "--redis-url", "redis://h:1/0"]))
    assert (cfg.workers, cfg.autoscaling, cfg.redis_url) == (4, None, "redis://h:1/0")


def test_misspelt_engine_flag_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.main(["--engine", '{"chunk_sise": 32}']) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "engine.chunk_sise" in err


@pytest.mark.parametrize("config,engine,fragment", [
    ("workers: [2\n", None, "not valid YAML"),
    ("- just\n- a list\n", None, "expected a mapping"),
    ("engine: null\nworkers: 2\n", None, "engine"),
    ("applications: []\n", None, "applications"),
    (None, "[1]", "JSON object"),
    (None, "{not json", "invalid configuration"),
])
def test_a_malformed_config_or_engine_flag_exits_2_with_a_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str | None, engine: str | None,
        fragment: str) -> None:
    argv: list[str] = []
    if config is not None:
        path = tmp_path / "app.yaml"
        path.write_text(config)
        argv += ["--config", str(path)]
    if engine is not None:
        argv += ["--engine", engine]
    assert launcher.main(argv) == 2  # no traceback: the launcher never starts
    err = capsys.readouterr().err
    assert "invalid configuration" in err and fragment in err


def test_start_refuses_a_config_without_a_redis_url() -> None:
    from chunkserve.router.app import AppConfig

    with pytest.raises(ValueError, match="redis_url"):
        launcher.start(AppConfig(), launcher.LaunchOptions())


def test_ray_env_runs_replica_code_on_the_replica_loop_unless_the_user_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", raising=False)
    monkeypatch.delenv("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", raising=False)
    env = launcher.ray_env_vars("redis://127.0.0.1:1/0")
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    assert env["CHUNKSERVE_REDIS_URL"] == "redis://127.0.0.1:1/0"
    monkeypatch.setenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "1")
    assert launcher.ray_env_vars("redis://x:1/0")["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"


def test_ray_env_slows_serves_control_loop_to_half_a_second_unless_the_user_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", raising=False)
    assert launcher.ray_env_vars("redis://x:1/0")["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")
    assert launcher.ray_env_vars("redis://x:1/0", "haproxy")["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"


def test_front_haproxy_turns_on_rays_haproxy_mode_with_free_side_ports_and_a_short_ingress_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
                "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"):
        monkeypatch.delenv(key, raising=False)
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in launcher.ray_env_vars("redis://x:1/0")  # the default front: Ray's proxy
    env = launcher.ray_env_vars("redis://x:1/0", "haproxy")
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "1"  # long enough for HAProxy to drop it
    side = {int(env["RAY_SERVE_HAPROXY_METRICS_PORT"]), int(env["RAY_SERVE_HAPROXY_STATS_PORT"])}
    assert len(side) == 2 and not side & {9101, 8404}  # not Ray's fixed ports: two clusters can share a machine
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "8404")  # the user's value wins
    assert launcher.ray_env_vars("redis://x:1/0", "haproxy")["RAY_SERVE_HAPROXY_STATS_PORT"] == "8404"
    args = launcher.parse_args(["--front", "haproxy"])
    assert launcher.launch_options(args).front == "haproxy"


@pytest.mark.parametrize("joined", [False, True])
def test_stopping_after_joining_a_shared_cluster_deletes_only_chunkserves_app(
        monkeypatch: pytest.MonkeyPatch, joined: bool) -> None:
    import ray
    from ray import serve

    calls: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(serve, "delete", lambda name, _blocking=True: calls.append(f"serve.delete {name}"))
    launcher.shutdown(joined=joined)
    # --address: Serve and the other apps of the shared cluster keep running; ray.shutdown only disconnects
    assert calls == (["serve.delete chunkserve", "ray.shutdown"] if joined else ["serve.shutdown", "ray.shutdown"])
