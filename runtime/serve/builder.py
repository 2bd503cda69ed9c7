"""``build_app``: a validated config -> the Serve application. The only place that calls ``.bind``.

The same deployment, in Python::

    from ray import serve
    from specula.runtime.config import load_config
    from specula.runtime.serve.builder import build_app

    cfg = load_config({
        "model": {"path": "target"},
        "drafter": {"kind": "ngram", "options": {"max_n": 3}, "gamma": 4},
        "dataplane": {"host": "0.0.0.0"},
        "deployments": {
            "vision_encoder": {"device": "cuda", "ray_actor_options": {"num_cpus": 1, "num_gpus": 1}},
            "drafter_ensemble": {"device": "cuda", "ray_actor_options": {"num_cpus": 1, "num_gpus": 1}},
            "target_verifier": {"device": "cuda", "ray_actor_options": {"num_cpus": 1, "num_gpus": 1},
                                "autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                                       "target_ongoing_requests": 8}},
        },
    })
    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.http.route_prefix)

and in YAML, as a ``serve deploy`` config (``args`` is the same document; Serve calls ``app_builder(args)``)::

    applications:
      - name: specula
        route_prefix: /
        import_path: specula.runtime.serve.builder:app_builder
        args:
          model: {path: target}
          drafter: {kind: ngram, options: {max_n: 3}, gamma: 4}
          dataplane: {host: 0.0.0.0}
          deployments:
            vision_encoder: {device: cuda, ray_actor_options: {num_cpus: 1, num_gpus: 1}}
            drafter_ensemble: {device: cuda, ray_actor_options: {num_cpus: 1, num_gpus: 1}}
            target_verifier:
              device: cuda
              ray_actor_options: {num_cpus: 1, num_gpus: 1}
              autoscaling_config: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}

Placement, replicas and autoscaling come from the config's ``deployments`` section only (a ``deployments:`` list in
the Serve config would override them; cluster.yaml does not use one). A ``ray_actor_options.num_cpus`` left null is
sized here from the CPUs of the Ray cluster the builder runs in (placement.py; outside Ray, this machine's), so the
default config fits a 2-CPU laptop as well as a cluster; the replicas get the sized config. With
``drafter.gamma: 0`` no DrafterEnsemble is deployed and the verifier decodes alone; with ``drafter.colocate``
(decided here when null: placement.colocates) none is either, and each verifier replica drafts itself; with
``deployments.vision_encoder.colocate`` (placement.vision_colocates) no VisionEncoder is deployed and each verifier
replica encodes its requests' images with its target's own tower; with ``deployments.target_verifier.in_ingress``
(placement.verifier_in_ingress; all three are the default on one CPU node) no TargetVerifier is deployed either and
each Ingress replica runs the verifier's engine (``Ingress.hosted``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ray.serve import Application

from specula.runtime.config import SpeculaConfig, load_config
from specula.runtime.serve.deployments import DrafterEnsemble, Ingress, TargetVerifier, VisionEncoder
from specula.runtime.serve.placement import ClusterResources, deployed, size_reservations


def build_app(config: SpeculaConfig | dict | str | os.PathLike, *,
              engine_classes: Mapping[str, type] | None = None,
              cluster: ClusterResources | None = None) -> Application:
    """The Specula application: Ingress -> VisionEncoder, TargetVerifier <-> DrafterEnsemble.

    ``engine_classes`` replaces an engine by deployment key ("ingress", "vision_encoder", "drafter_ensemble",
    "target_verifier"); each class needs ``from_config(config)`` (the drafter's also takes ``advertise_host=``).
    ``cluster`` is what null CPU reservations are sized from (default: the connected Ray cluster, else this machine).
    """
    cfg = size_reservations(load_config(config), cluster)
    args = cfg.model_dump(mode="json")  # plain data: it is shipped to every replica and re-validated there
    engines = dict(engine_classes or {})
    unknown = set(engines) - set(type(cfg.deployments).model_fields)
    if unknown:
        raise ValueError(f"engine_classes has unknown deployment keys {sorted(unknown)}")
    d = cfg.deployments

    def kw(key: str) -> dict:
        return {"engine_cls": engines[key]} if key in engines else {}

    vision = None  # with vision_encoder.colocate the verifier encodes the images itself
    if "vision_encoder" in deployed(cfg):
        vision = VisionEncoder.options(**d.vision_encoder.serve_options()).bind(args, **kw("vision_encoder"))
    drafter = None
    if "drafter_ensemble" in deployed(cfg):  # gamma > 0 and not colocated with the verifier
        drafter = DrafterEnsemble.options(**d.drafter_ensemble.serve_options()).bind(args, **kw("drafter_ensemble"))
    hosted = {}
    verifier = None  # with target_verifier.in_ingress the ingress replica runs the verifier's engine itself
    if "target_verifier" in deployed(cfg):
        verifier = TargetVerifier.options(**d.target_verifier.serve_options()).bind(args, drafter,
                                                                                    **kw("target_verifier"))
    else:
        hosted = {"drafter": drafter, **({"verifier_cls": engines["target_verifier"]}
                                         if "target_verifier" in engines else {})}
    # the ingress's own admission (limits.max_concurrent_requests + max_queued_requests, then 503) must see every
    # request: Serve may not hold them back in its queue first (+16 for /health, /metrics and the like)
    ingress = d.ingress.serve_options()
    admitted = cfg.limits.max_concurrent_requests + cfg.limits.max_queued_requests + 16
    ingress["max_ongoing_requests"] = max(ingress["max_ongoing_requests"], admitted)
    return Ingress.options(**ingress).bind(args, vision, verifier, **kw("ingress"), **hosted)


def app_builder(args: dict) -> Application:
    """Entry point of ``import_path: specula.runtime.serve.builder:app_builder`` in a ``serve deploy`` config."""
    return build_app(dict(args))
