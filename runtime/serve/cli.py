"""``specula serve --config cfg.yaml``: start Ray (local, or join one) and Serve, deploy the application, block.

    specula serve --config specula.yaml                    # a local Ray on this machine
    specula serve --config specula.yaml --address auto     # join a running cluster (e.g. the head of cluster.yaml)

Ctrl-C (or SIGTERM) shuts down cleanly: with a local Ray, Serve and Ray stop; on a cluster only this application is
deleted and the cluster keeps running. Wiring::

    p = sub.add_parser("serve", help="serve the application on Ray Serve")
    add_serve_arguments(p)
    p.set_defaults(func=serve_cli)
"""

from __future__ import annotations

import argparse
import signal
import time


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config (see specula.runtime.config; unknown keys are errors)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto' or host:port); default: start a local Ray on this machine")
    p.add_argument("--host", default=None, help="HTTP bind address (default: the config's http.host)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's http.port)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs a local Ray may use (default: all)")
    p.add_argument("--num-gpus", type=int, default=None, help="GPUs a local Ray may use (default: all)")
    p.add_argument("--ray-temp-dir", default=None, help="temp/log dir of a local Ray (default: Ray's)")


def serve_cli(args: argparse.Namespace) -> int:
    from specula.runtime.config import load_config

    cfg = load_config(args.config)
    http = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if http:
        cfg = load_config({**cfg.model_dump(mode="json"), "http": {**cfg.http.model_dump(), **http}})

    import ray
    from ray import serve

    from specula.runtime.serve.builder import build_app

    local = args.address is None
    init = {"address": args.address} if not local else {
        k: v for k, v in (("num_cpus", args.num_cpus), ("num_gpus", args.num_gpus), ("_temp_dir", args.ray_temp_dir))
        if v is not None}
    app = build_app(cfg)  # validate and bind before anything starts
    ray.init(**init)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(app, name=cfg.name, route_prefix=cfg.http.route_prefix, blocking=False)
        url = f"http://{cfg.http.host}:{cfg.http.port}{cfg.http.route_prefix.rstrip('/')}/generate"
        print(f"specula: serving {cfg.name!r} (model {cfg.model.path}, drafter {cfg.drafter.kind}, "
              f"gamma {cfg.drafter.gamma}); POST {url}; Ctrl-C stops", flush=True)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("specula: shutting down", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(cfg.name)
        finally:
            ray.shutdown()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
