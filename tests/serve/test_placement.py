"""Multi-node placement on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``): three nodes (the head
and two workers) advertising one logical GPU each. The application from ``build_app`` asks ``num_gpus: 1`` for
VisionEncoder, DrafterEnsemble and TargetVerifier (device stays ``cpu``: the GPUs are logical), so the only way to
place them is one per node; each replica reports its node and Ray GPU ids, and a real greedy request through
HTTP (image encoded on one node, drafted on another, verified on a third) equals plain target decoding.
"""

from __future__ import annotations

import json

import pytest

from specula.runtime.config import load_config
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.serve import IngressEngine
from specula.targets import load_target

from ray_kit import free_port, post, ray_env, run_app, start_cluster
from serve_kit import make_config, world_body

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]

GPU_DEPLOYMENTS = {"vision_encoder": "VisionEncoder", "drafter_ensemble": "DrafterEnsemble",
                   "target_verifier": "TargetVerifier"}


def _gpu_config(model_dir, port: int):
    raw = make_config(model_dir, http={"host": "127.0.0.1", "port": port}).model_dump(mode="json")
    for key in GPU_DEPLOYMENTS:
        raw["deployments"][key]["ray_actor_options"] = {"num_cpus": 0, "num_gpus": 1}
        assert raw["deployments"][key]["device"] == "cpu"
    return load_config(raw)


@pytest.fixture(scope="module")
def cluster_app(model_dir):
    ray = pytest.importorskip("ray")
    from ray import serve
    from specula.runtime.serve.builder import build_app

    port = free_port()
    cfg = _gpu_config(model_dir, port)
    with ray_env() as tmp:
        worker = {"num_cpus": 1, "num_gpus": 1, "object_store_memory": 80 * 1024 * 1024}
        cluster = start_cluster(temp_dir=tmp, include_dashboard=False, workers=(worker, worker), **worker)
        try:
            ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
            serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
            run_app(build_app(cfg), cfg.name, timeout=300.0)  # three nodes start slowly on a loaded 2-core machine
            yield cfg, f"http://127.0.0.1:{port}", {n.node_id for n in cluster.list_all_nodes()}
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                cluster.shutdown()


def test_three_gpu_deployments_land_on_distinct_nodes_and_gpus(cluster_app):
    from ray import serve

    cfg, _, cluster_nodes = cluster_app
    where = {}
    for name in GPU_DEPLOYMENTS.values():
        handle = serve.get_deployment_handle(name, app_name=cfg.name)
        where[name] = handle.placement.remote().result(timeout_s=30)
    nodes = {p["node_id"] for p in where.values()}
    gpus = {(p["node_id"], tuple(p["gpu_ids"])) for p in where.values()}
    assert len(cluster_nodes) == 3 and nodes == cluster_nodes, where  # one per node: each node has one GPU
    assert all(len(p["gpu_ids"]) == 1 for p in where.values()), where  # one (logical) GPU each, as asked
    assert len(gpus) == 3, where
    assert all(p["device"] == "cpu" for p in where.values())


def test_a_request_across_three_nodes_equals_plain_decoding(cluster_app, model_dir):
    cfg, url, _ = cluster_app
    body = world_body(0, max_tokens=12)  # a VQA prompt with one image: all three deployments take part
    ingress = IngressEngine.from_config(cfg)
    req = ingress.prepare(ingress.parse(body), "ref")
    plain = SpecEngine(load_target(model_dir), None, gamma=0).generate([req])["ref"].tokens

    status, raw = post(f"{url}/generate", body, timeout=90)
    assert status == 200, raw[:500]
    got = json.loads(raw)
    assert got["tokens"] == plain
    assert got["drafter"] == "ok"  # the drafts came over gRPC from the DrafterEnsemble on its own node
    assert got["metrics"]["blocks"] >= 1
