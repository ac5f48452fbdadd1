"""Typed application config: `AppConfig.engine` is the workers' `EngineConfig`, `AppConfig.router` a
`RouterConfig`, both validated by `app_builder` (the function `serve deploy` / `serve run` call with the YAML's
``args``), so a misspelt field fails the build at once, naming it. Building the app loads no torch."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from chunkserve.router.app import AppConfig, RouterConfig, ServeIngress, app_builder
from chunkserve.workers.engine_config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def _deploy_args() -> dict[str, dict[str, Any]]:
    """Each deploy/*.yaml's first application's args (the KubeRay file carries its Serve config as a string)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted((ROOT / "deploy").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict) and "spec" in doc and "serveConfigV2" in doc["spec"]:
            doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
        if isinstance(doc, dict) and doc.get("applications"):
            app = doc["applications"][0]
            assert app["import_path"] == "chunkserve.router.app:app_builder"
            found[path.name] = app.get("args") or {}
    return found


def test_every_deploy_yaml_builds_through_app_builder() -> None:
    configs = _deploy_args()
    assert {"local.yaml", "gpu-cluster.yaml", "kuberay-rayservice.yaml"} <= set(configs)
    for name, args in configs.items():
        if args.get("tenants") and not Path(args["tenants"]).exists():  # a path on the cluster's nodes
            args = {**args, "tenants": str(ROOT / "deploy" / "tenants.example.yaml")}
        app = app_builder(args)
        assert type(app).__name__ == "Application", name
        cfg = AppConfig(**args)
        assert isinstance(cfg.engine, EngineConfig) and isinstance(cfg.router, RouterConfig)


@pytest.mark.parametrize(("args", "field"), [
    ({"engine": {"chunk_sise": 32}}, "engine.chunk_sise"),
    ({"router": {"policy": {"spil_abs": 2}}}, "router.policy.spil_abs"),
    ({"router": {"max_chunk": 8}}, "router.max_chunk"),
    ({"worker": 2}, "worker"),
    ({"engine": {"chunk_size": "big"}}, "engine.chunk_size"),
])
def test_misspelt_or_ill_typed_field_fails_app_builder_naming_it(args: dict[str, Any], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        app_builder({"model_name": "m", **args})
    assert field in str(err.value)


def test_engine_rule_violations_fail_the_build() -> None:
    with pytest.raises(pydantic.ValidationError, match="power of two"):
        app_builder({"engine": {"chunk_size": 48}})
    with pytest.raises(pydantic.ValidationError, match="top-level AppConfig fields"):
        app_builder({"router": {"namespace": "elsewhere"}})


def test_serve_run_style_json_strings_are_parsed() -> None:
    app_builder({"engine": '{"chunk_size": 32}', "router": '{"max_chunks": 8}'})
    with pytest.raises(pydantic.ValidationError, match="engine.chunk_sise"):
        app_builder({"engine": '{"chunk_sise": 32}'})


def test_config_survives_the_json_trip_to_the_ingress_replica() -> None:
    cfg = AppConfig(model="random:tiny", engine={"chunk_size": 16, "max_model_len": 300},
                    router={"policy": {"spill_abs": 3}, "max_chunks": 9})
    back = AppConfig.model_validate_json(cfg.model_dump_json())
    assert back == cfg
    assert back.engine.chunk_size == 16 and back.router.policy.spill_abs == 3
    kw = back.router.kwargs()
    assert kw["max_chunks"] == 9 and kw["policy"]["spill_abs"] == 3 and kw["predictions"] is True


class _Handle:
    """A DeploymentHandle stand-in: the ingress only calls ``options`` at construction."""

    def options(self, **_: Any) -> _Handle:
        return self


def test_ingress_takes_chunk_size_and_context_length_from_the_engine_config(monkeypatch) -> None:
    import chunkserve.router.app as app_mod

    monkeypatch.setattr(app_mod, "_model_info", lambda model: (object(), 2048, 1000))
    cfg = AppConfig(model="random:tiny", engine={"chunk_size": 16, "max_model_len": 300}, redis_url=None)
    monkeypatch.delenv("CHUNKSERVE_REDIS_URL", raising=False)
    handle = _Handle()
    ing = ServeIngress(handle, cfg.model_dump_json())
    assert (ing.config.chunk_size, ing.config.max_model_len) == (16, 300)
    assert gc.get_freeze_count() > 0  # a replica's start-up heap leaves the cyclic GC (chunkserve/heap.py)
    ing = ServeIngress(handle, AppConfig(engine={"chunk_size": 128}).model_dump_json())
    assert (ing.config.chunk_size, ing.config.max_model_len) == (128, 2048)  # engine unset: the model's


def test_the_ingress_tokenises_for_the_model_the_workers_load(monkeypatch) -> None:
    """With only engine.model set, the ingress took the embedded SmolLM2's tokenizer, context and vocabulary."""
    import chunkserve.router.app as app_mod

    seen: list[str | None] = []
    monkeypatch.setattr(app_mod, "_model_info", lambda model: (seen.append(model), object(), 2048, 1000)[1:])
    monkeypatch.delenv("CHUNKSERVE_REDIS_URL", raising=False)
    ServeIngress(_Handle(), AppConfig(engine={"model": "random:tiny"}).model_dump_json())
    assert seen == ["random:tiny"]


@pytest.mark.parametrize(("args", "fragment"), [
    ({"workers": 4, "autoscaling": {"min_replicas": 1, "max_replicas": 2}}, "either workers"),
    ({"autoscaling": {"min_replicas": 1, "max_replica": 16}}, "max_replica"),  # Ray ignored it: one worker
    ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling"),
    ({"model": "random:tiny", "engine": {"model": "/models/other"}}, "differ"),
    ({"lease_ttl_s": 0}, "lease_ttl_s"),
    ({"lease_ttl_s": float("nan")}, "lease_ttl_s"),
    ({"engine": {"attention_backend": "trition"}}, "attention_backend"),
    ({"engine": {"dtype": "float64"}}, "dtype"),
    ({"engine": {"device": "gpu"}}, "device"),
    ({"engine": {"max_pinned_fraction": 1.0}}, "max_pinned_fraction"),
    ({"engine": {"extra": {"chunk_size": 32}}}, "extra"),
])
def test_values_that_were_ignored_or_failed_in_a_replica_are_refused_at_load(args: dict[str, Any],
                                                                               fragment: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=fragment):
        AppConfig(**args)


def test_a_tenants_file_that_is_missing_or_invalid_fails_app_builder(tmp_path: Path) -> None:
    bad = tmp_path / "tenants.yaml"
    bad.write_text("tenants:\n  - id: acme\n    api_key_sha256: ['" + "0" * 64 + "']\n    rate_limits: {}\n")
    with pytest.raises(ValueError, match="rate_limits"):
        app_builder({"tenants": str(bad)})
    with pytest.raises(ValueError, match="No such file"):
        app_builder({"tenants": str(tmp_path / "absent.yaml")})


def test_worker_engine_carries_the_model_and_the_gpu_device() -> None:
    eng = AppConfig(model="random:tiny", worker_num_gpus=1).worker_engine()
    assert (eng.model, eng.device) == ("random:tiny", "cuda")
    eng = AppConfig(engine={"model": "random:small", "device": "cuda:1"}).worker_engine()
    assert (eng.model, eng.device) == ("random:small", "cuda:1")
    eng = AppConfig(model="random:small", engine={"model": "random:small"}).worker_engine()  # the same: fine
    assert eng.model == "random:small"
    assert AppConfig().worker_engine().device == "cpu"


def test_building_the_app_imports_no_torch() -> None:
    code = ("import sys, yaml; from chunkserve.router.app import app_builder; "
            "app_builder(yaml.safe_load(open('deploy/local.yaml'))['applications'][0]['args']); "
            "print(sorted(m for m in ('torch', 'chunkserve.workers.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
