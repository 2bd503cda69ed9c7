"""The runtime config: every field described, unknown keys and bad values refused with the field's path, placement
rules (a cuda device needs a reserved GPU; replicas are fixed or autoscaled, not both), and the CLI's arguments."""

from __future__ import annotations

import argparse

import pytest
from pydantic import BaseModel

from specula.runtime.config import ConfigError, SpeculaConfig, load_config


def _models(model: type[BaseModel], seen=None):
    seen = set() if seen is None else seen
    if model in seen:
        return
    seen.add(model)
    yield model
    for f in model.model_fields.values():
        for t in (f.annotation, *getattr(f.annotation, "__args__", ())):
            if isinstance(t, type) and issubclass(t, BaseModel):
                yield from _models(t, seen)


def test_every_field_has_a_description_and_unknown_keys_are_forbidden():
    models = list(_models(SpeculaConfig))
    assert len(models) >= 10
    for m in models:
        assert m.model_config.get("extra") == "forbid", m.__name__
        for name, f in m.model_fields.items():
            assert f.description and len(f.description) > 10, f"{m.__name__}.{name}"


@pytest.mark.parametrize("raw, path", [
    ({"modle": {"path": "x"}}, "modle: unknown key"),
    ({"deployments": {"vision_encoder": {"devise": "cpu"}}}, "deployments.vision_encoder.devise: unknown key"),
    ({"drafter": {"gama": 4}}, "drafter.gama: unknown key"),
    ({"deployments": {"target_verifier": {"ray_actor_options": {"num_gpu": 1}}}},
     "deployments.target_verifier.ray_actor_options.num_gpu: unknown key"),
])
def test_unknown_key_is_refused_naming_it(raw, path):
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        load_config(raw)


@pytest.mark.parametrize("section, match", [
    ({"device": "gpu"}, "device must be 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": "cuda"}, "needs ray_actor_options.num_gpus > 0"),
    ({"device": "cuda:1", "ray_actor_options": {"num_gpus": 1}}, "beyond the 1 GPU"),
    ({"num_replicas": 2, "autoscaling_config": {"max_replicas": 3}}, "exactly one of num_replicas"),
    ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas .3. > max_replicas .2."),
    ({"max_ongoing_requests": 0}, "max_ongoing_requests"),
])
def test_bad_deployment_settings_are_refused(section, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"deployments": {"target_verifier": section}})


def test_placement_and_scaling_become_serve_options():
    cfg = load_config({"deployments": {
        "target_verifier": {"device": "cuda:1", "ray_actor_options": {"num_gpus": 2, "num_cpus": 2},
                            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}},
        "vision_encoder": {"num_replicas": 2},
    }})
    v = cfg.deployments.target_verifier.serve_options()
    assert v["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 2.0} and "num_replicas" not in v
    assert v["autoscaling_config"]["max_replicas"] == 4
    assert cfg.deployments.vision_encoder.serve_options()["num_replicas"] == 2


def test_model_path_and_drafter_kinds_are_checked_at_load_time(tmp_path):
    with pytest.raises(ConfigError, match=r"^config: model\.path: /nowhere/llava does not exist \(neither a local "
                                          r"directory nor a shipped zoo entry: .*\btarget\b"):
        load_config({"model": {"path": "/nowhere/llava"}})
    assert load_config({"model": {"path": "target"}}).model.path == "target"  # a shipped zoo entry
    assert load_config({"model": {"path": str(tmp_path)}}).model.path == str(tmp_path)  # a local directory
    with pytest.raises(ConfigError, match=r"^config: drafter\.kind: 'foo' is not a drafter kind; known: .*\bngram\b"):
        load_config({"drafter": {"kind": "foo"}})
    with pytest.raises(ConfigError, match=r"drafter\.alternatives\.fast\.kind: 'ngramm' is not a drafter kind; "
                                          r"known: .*\beagle\b"):
        load_config({"drafter": {"alternatives": {"fast": {"kind": "ngramm"}}}})


def test_cpu_reservations_default_to_sized_and_explicit_ones_are_kept():
    cfg = load_config({})
    assert all(getattr(cfg.deployments, k).ray_actor_options.num_cpus is None
               for k in ("ingress", "vision_encoder", "drafter_ensemble", "target_verifier"))
    pinned = load_config({"deployments": {"ingress": {"ray_actor_options": {"num_cpus": 0.25}}}})
    assert pinned.deployments.ingress.serve_options()["ray_actor_options"] == {"num_cpus": 0.25, "num_gpus": 0.0}
    assert pinned.deployments.ingress.threads() == 1
    with pytest.raises(ConfigError, match="deployments.ingress.ray_actor_options.num_cpus"):
        load_config({"deployments": {"ingress": {"ray_actor_options": {"num_cpus": -1}}}})


def test_codecs_are_checked():
    with pytest.raises(ConfigError, match="drafter.codec_preference.*unknown codec 'fp8'"):
        load_config({"drafter": {"codec_preference": ["fp8"]}})
    assert load_config({"drafter": {"accept_codecs": ["int8+zstd"]}}).drafter.accept_codecs == ["int8+zstd"]


def test_yaml_file_loads_and_problems_name_the_file(tmp_path):
    checkpoint = tmp_path / "llava"
    checkpoint.mkdir()
    good = tmp_path / "ok.yaml"
    good.write_text(f"model: {{path: {checkpoint}}}\ndrafter: {{kind: ngram, gamma: 3}}\n")
    cfg = load_config(good)
    assert (cfg.model.path, cfg.drafter.gamma, cfg.deployments.ingress.num_replicas) == (str(checkpoint), 3, 1)
    assert load_config(cfg) is cfg
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter: {gamma: -1}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: drafter\.gamma: Input should be greater than or equal to 0"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")


def test_serve_cli_arguments():
    from specula.runtime.serve.launch import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    a = p.parse_args(["--config", "c.yaml", "--port", "9000", "--num-cpus", "2"])
    assert (a.config, a.port, a.num_cpus, a.address, a.host) == ("c.yaml", 9000, 2, None, None)
    assert a.placement_timeout is None  # its default depends on --address
    assert p.parse_args(["--placement-timeout", "0"]).placement_timeout == 0
    assert p.parse_args([]).config is None  # no config: the shipped default
    with pytest.raises(SystemExit):
        p.parse_args(["--port", "not-a-port"])
