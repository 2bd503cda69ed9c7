"""cluster.yaml is a cluster launcher config Ray accepts, and its embedded `serve deploy` config is one Serve and
Specula accept: both checked with Ray's own schemas, and the application it names actually builds."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")  # Ray's own pydantic use


@pytest.fixture(scope="module")
def cluster():
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_validates_against_rays_cluster_schema(cluster):
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(cluster, schema)  # the file as written
    validate_config(prepare_config(copy.deepcopy(cluster)))  # what `ray up` validates, defaults filled in


def test_gpu_deployments_land_on_separate_gpus_and_the_cluster_can_hold_them(cluster):
    from specula.runtime.config import load_config

    app = cluster["metadata"]["specula_serve_config"]["applications"][0]
    cfg = load_config(app["args"])
    d = cfg.deployments
    gpu = [d.vision_encoder, d.drafter_ensemble, d.target_verifier]
    assert all(s.device.startswith("cuda") and s.ray_actor_options.num_gpus == 1 for s in gpu)
    most = sum(s.autoscaling_config.max_replicas if s.autoscaling_config else s.num_replicas for s in gpu)
    worker = cluster["available_node_types"]["gpu_worker"]
    assert worker["resources"]["GPU"] == 1 and worker["min_workers"] >= 3
    assert most <= worker["max_workers"] <= cluster["max_workers"]
    assert cfg.dataplane.host == "0.0.0.0"  # verifiers on other nodes must reach the drafters


def test_embedded_serve_config_validates_and_builds(cluster):
    from ray.serve.schema import ServeDeploySchema

    from specula.runtime.serve.builder import app_builder

    serve_cfg = cluster["metadata"]["specula_serve_config"]
    schema = ServeDeploySchema.model_validate(serve_cfg)
    (app,) = schema.applications
    module, _, attr = app.import_path.partition(":")
    assert (module, attr) == ("specula.runtime.serve.builder", "app_builder")
    built = app_builder(app.args)  # binds the four deployments; nothing starts
    assert type(built).__name__ == "Application"


def test_head_commands_deploy_exactly_the_embedded_config(cluster):
    cmds = "\n".join(cluster["head_start_ray_commands"])
    assert "['metadata']['specula_serve_config']" in cmds and "serve deploy /home/ubuntu/specula-serve.yaml" in cmds
    assert any("pip install" in c and "-e /home/ubuntu/specula" in c for c in cluster["setup_commands"])
    assert os.path.basename(list(cluster["file_mounts"])[0]) == "specula"
