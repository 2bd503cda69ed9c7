"""``specula serve [--config cfg.yaml]``: start Ray (local, or join one) and Serve, deploy the application, block.

    specula serve                                          # the shipped embedded target, HTTP :8000 + gRPC :50051
    specula serve /models/llava-1.5-7b --drafter runs/eagle-llava --gamma 5   # flags like vLLM's (config_front_door)
    specula serve --config specula.yaml                    # a local Ray on this machine
    specula serve --config specula.yaml --address auto     # join a running cluster (e.g. the head of cluster.yaml)

CPU reservations left null in the config (the default) are sized from the CPUs Ray sees (placement.py), so the
default config starts on a 2-CPU machine. A config that cannot fit its local Ray (a replica asking more CPUs or
GPUs than the machine has) is refused (exit 1) before Ray starts, and checked again against what the started Ray
has; on a cluster it is only a warning (an autoscaler may add nodes). With a local Ray, an HTTP port that another
process holds is refused before Ray starts as well. While the application starts, a replica that
Serve cannot place (it reports it waiting for resources) for longer than ``--placement-timeout`` ends the start:
``specula serve`` prints which deployment, what it asks, what the cluster has and which config field to change,
stops what it started and exits 1. So does an application that fails to deploy. ``specula: serving ...`` is
printed once the application is RUNNING.

Ctrl-C (or SIGTERM, e.g. from a process supervisor) shuts down cleanly: it prints ``specula: shutting down``; with a
local Ray, Serve and Ray stop; on a cluster only this application is deleted and the cluster keeps running; then it
prints ``specula: stopped`` and exits 0. A second SIGTERM during the cleanup is ignored. Wiring::

    p = sub.add_parser("serve", help="serve the application on Ray Serve")
    add_serve_arguments(p)
    p.set_defaults(func=serve_cli)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

# How long a replica may wait for resources (Serve reports one waiting after 30 s) before the start is given up.
# A local Ray runs nothing else, so a config that fits it (checked before deploying) only waits for worker processes
# to start; a cluster's autoscaler may be starting nodes (minutes for a GPU node).
LOCAL_PLACEMENT_TIMEOUT_S = 120.0
CLUSTER_PLACEMENT_TIMEOUT_S = 900.0

# A local Ray started for one application on a small machine: its own processes wake up many times a second even
# with no request (measured on 2 cores: 0.13 of a core idle, and in-process decoding beside such an idle Ray runs
# 16% slower: a two-thread forward waits at every barrier for whichever thread was preempted). So, unless the user
# set them: replicas run at normal priority instead of Ray's nice 15 (the verifier's forward is the work this
# machine is for; Ray's own daemons no longer preempt it at will), and Serve's controller loops every 0.5 s, not
# 0.1 s (replica health and autoscaling decisions are seconds apart anyway). The dashboard is off unless asked for.
LOCAL_RAY_ENV = {"RAY_worker_niceness": "0", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL_DIR",
                   help="the target: a local LLaVA / Qwen2.5-VL checkpoint directory or a shipped zoo entry "
                        "(overrides the config's model.path; default: the config's, else the embedded target)")
    p.add_argument("--drafter", default=None, metavar="KIND|DIR",
                   help="a trained drafter's directory (its specula.json names the kind and the target it was "
                        "trained for), a shipped drafter (flash, eagle, ... for the embedded target) or a kind "
                        "without weights (ngram); default: the config's drafter, else flash on the embedded "
                        "target and ngram on any other model")
    p.add_argument("--gamma", type=int, default=None, metavar="N",
                   help="draft tokens per block (0 = plain decoding); default: the config's drafter.gamma")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM-style JSON: method (ngram, draft_model, eagle, eagle3 or a Specula kind), model "
                        "(drafter dir), num_speculative_tokens, prompt_lookup_max, or any drafter.* field of the "
                        "config (overlap, predraft, ...)")
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
    p.add_argument("--dashboard", action="store_true",
                   help="start the Ray dashboard with a local Ray (default: off; an idle dashboard costs a few "
                        "percent of a core, which a small machine's decoding feels)")
    p.add_argument("--placement-timeout", type=float, default=None, metavar="S",
                   help="give up (exit 1, naming the deployment and the config field) when a replica still waits "
                        "for resources S seconds after the start; 0 = wait forever (default: "
                        f"{LOCAL_PLACEMENT_TIMEOUT_S:g} on a local Ray, {CLUSTER_PLACEMENT_TIMEOUT_S:g} with "
                        "--address)")


def config_from_args(args: argparse.Namespace):
    """The validated config ``specula serve`` runs: ``--config`` (or the defaults) with MODEL_DIR, --drafter,
    --gamma, --speculative-config, --host, --port and --grpc-port on top. The flags go on the file *before* it is
    checked, so a drafter record is checked against MODEL_DIR, not against the model the file alone would name.
    A bad config or flag: ``ConfigError`` (one line, exit 2)."""
    from specula.runtime.config import ConfigError, load_config, read_config
    from specula.runtime.config_front_door import apply_flags

    raw = read_config(args.config if args.config is not None else {})
    where = args.config or "config"
    flags = (args.model, args.drafter, args.gamma, args.speculative_config)
    if any(f is not None for f in flags):
        for key in ("model", "drafter"):
            if raw.get(key) is not None and not isinstance(raw[key], dict):
                raise ConfigError(f"{where}: {key}: must be a mapping, got {type(raw[key]).__name__}")
        raw = apply_flags(raw, *flags)
    http = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    for key, extra in (("http", http), ("grpc", {"port": args.grpc_port} if args.grpc_port is not None else {})):
        if extra:
            if raw.get(key) is not None and not isinstance(raw[key], dict):
                raise ConfigError(f"{where}: {key}: must be a mapping, got {type(raw[key]).__name__}")
            raw = {**raw, key: {**(raw.get(key) or {}), **extra}}
    return load_config(raw, where=str(where))


def direct_http(cfg, local: bool):
    """``cfg`` with ``http.direct`` decided where it is null: the Ingress replica serves HTTP itself on a local Ray
    (this machine) with one Ingress replica; behind Serve's proxy on a cluster or with more replicas."""
    if cfg.http.direct is not None:
        return cfg
    from specula.runtime.config import load_config

    raw = cfg.model_dump(mode="json")
    raw["http"]["direct"] = local and cfg.deployments.ingress.replicas_at_most() == 1
    return load_config(raw)


def serve_cli(args: argparse.Namespace) -> int:
    local = args.address is None
    cfg = direct_http(config_from_args(args), local)

    from specula.runtime.serve.placement import (ClusterResources, StartupError, placement_message,
                                                 placement_problems, size_reservations, watch_startup)

    init = {"address": args.address} if not local else {
        k: v for k, v in (("num_cpus", args.num_cpus), ("num_gpus", args.num_gpus), ("_temp_dir", args.ray_temp_dir))
        if v is not None}
    if local:
        init["include_dashboard"] = bool(getattr(args, "dashboard", False))
        for k, v in LOCAL_RAY_ENV.items():  # read by the raylet and the workers it starts
            os.environ.setdefault(k, v)
    timeout = args.placement_timeout
    if timeout is None:
        timeout = LOCAL_PLACEMENT_TIMEOUT_S if local else CLUSTER_PLACEMENT_TIMEOUT_S
    # a taken HTTP port is refused before Ray starts: one line, not a replica failing its start three times
    if local and (taken := _port_taken(cfg.http.host, cfg.http.port)):
        print(f"specula: cannot serve HTTP on {cfg.http.host}:{cfg.http.port}: {taken}; choose a free port with "
              "--port (http.port)", file=sys.stderr, flush=True)
        return 1
    if local:  # what cannot fit the Ray about to start is refused before it starts (seconds, not a Ray start)
        expected = ClusterResources.local(args.num_cpus, args.num_gpus)
        sized = size_reservations(cfg, expected)
        if problems := placement_problems(sized, expected):
            print(placement_message(sized, expected, problems, where="a local Ray on this machine"),
                  file=sys.stderr, flush=True)
            return 1

    import ray
    from ray import serve

    from specula.runtime.serve.builder import build_app

    build_app(cfg, cluster=ClusterResources.local(args.num_cpus, args.num_gpus))  # validate and bind first
    previous = signal.getsignal(signal.SIGTERM)
    deployed, code = False, 0
    try:
        # ray.init installs its own TERM handler (sys.exit: a TERM while starting still runs the cleanup below);
        # ours replaces it once Ray is up
        ray.init(**init)
        signal.signal(signal.SIGTERM, _interrupt)
        cluster = ClusterResources.from_ray()
        cfg = size_reservations(cfg, cluster)  # null reservations from the CPUs this Ray has
        problems = placement_problems(cfg, cluster)
        if problems:
            message = placement_message(cfg, cluster, problems)
            if local:  # nothing else will ever add resources to a Ray we started
                raise StartupError(message)
            print(f"{message}\nspecula: deploying anyway: the cluster may scale up (--placement-timeout "
                  f"{timeout:g} s)", file=sys.stderr, flush=True)
        # http.direct: the Ingress replica listens on http.host:http.port, and Serve runs no proxy at all (one
        # process less: ~1% of a core and ~180 wake-ups a second on an idle 2-core machine)
        if cfg.http.direct:
            serve.start(proxy_location="Disabled")
        else:
            serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        deployed = True
        serve.run_many([serve.RunTarget(build_app(cfg), name=cfg.name, route_prefix=cfg.http.route_prefix)],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        watch_startup(cfg, timeout or None)
        from specula.runtime.serve.openai_api import http_examples

        url = f"http://{cfg.http.host}:{cfg.http.port}{cfg.http.route_prefix.rstrip('/')}"
        where = "off" if cfg.drafter.gamma == 0 else ("in the verifier" if cfg.drafter.colocate else "separate")
        vision = "in the verifier" if cfg.deployments.vision_encoder.colocate else "separate"
        verifier = "in the ingress" if cfg.deployments.target_verifier.in_ingress else "separate"
        door = "HTTP from the ingress replica" if cfg.http.direct else "HTTP through Serve's proxy"
        d = cfg.drafter
        route = f" ({d.text_only} for requests without images)" if d.text_only and d.gamma > 0 else ""
        print(f"specula: serving {cfg.name!r} (model {cfg.model.path}, drafter {cfg.drafter.kind}{route}, "
              f"gamma {cfg.drafter.gamma}, drafting {where}, vision {vision}, verifier {verifier}, {door}) on {url}; "
              "Ctrl-C stops\n"
              f"{http_examples(cfg)}", flush=True)
        from specula.runtime.serve.grpc_api import grpcurl_example

        if (example := grpcurl_example(cfg)) is not None:
            print(example, flush=True)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("specula: shutting down", flush=True)
    except StartupError as e:
        print(f"{e}\nspecula: shutting down", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second TERM must not cut the cleanup short
        try:
            if ray.is_initialized() and deployed:
                _stop(serve, cfg.name, local)
        finally:
            ray.shutdown()
            signal.signal(signal.SIGTERM, previous)
    print("specula: stopped", flush=True)
    return code


def _stop(serve, name: str, local: bool) -> None:
    """A local Ray: stop Serve (replicas finish their __del__: gRPC servers stop, verifier loops end). A cluster:
    delete only this application; the cluster and other applications keep running."""
    if local:
        serve.shutdown()
    else:
        serve.delete(name)


def _port_taken(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on now (e.g. "address already in use"), or None when it can (as the door
    binds it: ``direct_http.bind``, without waiting); port 0 is always free."""
    from specula.runtime.serve.direct_http import bind

    if port == 0:
        return None
    try:
        bind(host, port, wait_s=0).close()
    except OSError as e:
        return os.strerror(e.errno).lower() if e.errno else str(e)
    return None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
