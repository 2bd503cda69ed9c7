"""``specula serve [--config cfg.yaml]``: start Ray (local, or join one) and Serve, deploy the application, block.

    specula serve                                          # the shipped embedded target, HTTP :8000 + gRPC :50051
    specula serve --config specula.yaml                    # a local Ray on this machine
    specula serve --config specula.yaml --address auto     # join a running cluster (e.g. the head of cluster.yaml)

Ctrl-C (or SIGTERM, e.g. from a process supervisor) shuts down cleanly: it prints ``specula: shutting down``; with a
local Ray, Serve and Ray stop; on a cluster only this application is deleted and the cluster keeps running; then it
prints ``specula: stopped`` and exits 0. A second SIGTERM during the cleanup is ignored. Wiring::

    p = sub.add_parser("serve", help="serve the application on Ray Serve")
    add_serve_arguments(p)
    p.set_defaults(func=serve_cli)
"""

from __future__ import annotations

import argparse
import signal
import time


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="YAML config (see specula.runtime.config; unknown keys are errors); default: the shipped "
                        "embedded target with the config's defaults (HTTP 127.0.0.1:8000, gRPC 127.0.0.1:50051)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto' or host:port); default: start a local Ray on this machine")
    p.add_argument("--host", default=None, help="HTTP bind address (default: the config's http.host)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's http.port)")
    p.add_argument("--grpc-port", type=int, default=None, help="public gRPC API port (default: the config's grpc.port)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs a local Ray may use (default: all)")
    p.add_argument("--num-gpus", type=int, default=None, help="GPUs a local Ray may use (default: all)")
    p.add_argument("--ray-temp-dir", default=None, help="temp/log dir of a local Ray (default: Ray's)")


def serve_cli(args: argparse.Namespace) -> int:
    from specula.runtime.config import load_config

    cfg = load_config(args.config if args.config is not None else {})
    http = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if http or args.grpc_port is not None:
        raw = cfg.model_dump(mode="json")
        raw["http"] = {**raw["http"], **http}
        if args.grpc_port is not None:
            raw["grpc"] = {**raw["grpc"], "port": args.grpc_port}
        cfg = load_config(raw)

    import ray
    from ray import serve

    from specula.runtime.serve.builder import build_app

    local = args.address is None
    init = {"address": args.address} if not local else {
        k: v for k, v in (("num_cpus", args.num_cpus), ("num_gpus", args.num_gpus), ("_temp_dir", args.ray_temp_dir))
        if v is not None}
    app = build_app(cfg)  # validate and bind before anything starts
    previous = signal.getsignal(signal.SIGTERM)
    try:
        # ray.init installs its own TERM handler (sys.exit: a TERM while starting still runs the cleanup below);
        # ours replaces it once Ray is up
        ray.init(**init)
        signal.signal(signal.SIGTERM, _interrupt)
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(app, name=cfg.name, route_prefix=cfg.http.route_prefix, blocking=False)
        from specula.runtime.serve.openai_api import http_examples

        url = f"http://{cfg.http.host}:{cfg.http.port}{cfg.http.route_prefix.rstrip('/')}"
        print(f"specula: serving {cfg.name!r} (model {cfg.model.path}, drafter {cfg.drafter.kind}, "
              f"gamma {cfg.drafter.gamma}) on {url}; Ctrl-C stops\n{http_examples(cfg)}", flush=True)
        from specula.runtime.serve.grpc_api import grpcurl_example

        if (example := grpcurl_example(cfg)) is not None:
            print(example, flush=True)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("specula: shutting down", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second TERM must not cut the cleanup short
        try:
            if ray.is_initialized():
                _stop(serve, cfg.name, local)
        finally:
            ray.shutdown()
            signal.signal(signal.SIGTERM, previous)
    print("specula: stopped", flush=True)
    return 0


def _stop(serve, name: str, local: bool) -> None:
    """A local Ray: stop Serve (replicas finish their __del__: gRPC servers stop, verifier loops end). A cluster:
    delete only this application; the cluster and other applications keep running."""
    if local:
        serve.shutdown()
    else:
        serve.delete(name)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
