"""Where the replicas go: CPU reservations sized from the cluster, a check that the application fits the cluster,
and the watchdog of ``specula serve`` that gives up (naming the deployment and the config field) when Serve cannot
place a replica, instead of waiting forever.

Sizing (``size_reservations``, called by ``build_app``): every deployment whose ``ray_actor_options.num_cpus`` is
null gets a share of the cluster's CPUs, after the explicit reservations are taken out::

    per replica = (cluster CPUs - explicit reservations) * weight / sum(weight * replicas) of the null ones
    weights: ingress 1, vision_encoder 1, drafter_ensemble 1 (only with a separate drafter), target_verifier 2
             (ingress 3 when the verifier runs inside it, ``deployments.target_verifier.in_ingress``)
    replicas: num_replicas, or autoscaling_config.max_replicas (so the autoscaler can place all of them)

rounded down (to Ray's 0.0001 CPU below one CPU, to whole CPUs above) and never above the largest node's CPUs, so
the application always fits: 0.4 / 0.4 / 0.4 / 0.8 CPUs on a 2-CPU machine, 1 / 1 / 1 / 3 on an 8-CPU one (with a
colocated drafter, ``drafter.colocate``, there is no DrafterEnsemble: 0.5 / 0.5 / 1.0 on 2 CPUs; with the vision
encoder colocated too, ``deployments.vision_encoder.colocate``, no VisionEncoder either: ingress 0.6666 / verifier
1.0; with the verifier inside the ingress as well, ``deployments.target_verifier.in_ingress``, the default on one
CPU node, one Ingress replica of 2 CPUs is the whole application). Each replica's torch threads then follow its
reservation (``DeploymentSettings.threads``), except a sized verifier's (in its own replica or the ingress's),
which takes the node's CPUs less a separate drafter's threads (``verifier_threads``: 2 on a 2-CPU laptop with the
drafter colocated, 1 with it separate). Explicit values are honoured as given (cluster.yaml reserves 1 CPU and 1
GPU per model deployment).

Checking (``placement_problems``): with the reservations known, does every replica fit? A replica asking more than
any node has, or deployments asking more in all than the cluster has, cannot be placed on this cluster as it is.
``specula serve`` on its own local Ray refuses such a config before starting Ray (from what that Ray will have:
``--num-cpus`` or the CPUs Ray counts here) and again once it runs (from what it has); joined to a cluster
(``--address``) it only warns, since an autoscaler may add nodes.

Watching (``watch_startup``): ``serve.status()`` until the application is RUNNING. Serve reports a replica that has
waited over 30 s for resources ("... to be scheduled"); one still waiting after the placement timeout, or an
application in DEPLOY_FAILED, ends the wait with a ``StartupError`` whose message names the deployment, what each
replica asks, what the cluster has and the config fields to change.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specula.runtime.config import DeploymentSettings, SpeculaConfig, load_config

# config key -> the Serve deployment's name (its class in deployments.py)
DEPLOYMENTS = {"ingress": "Ingress", "vision_encoder": "VisionEncoder", "drafter_ensemble": "DrafterEnsemble",
               "target_verifier": "TargetVerifier"}
# shares of the cluster's CPUs per replica, for reservations left null: the verifier runs every request's decode loop
WEIGHTS = {"ingress": 1, "vision_encoder": 1, "drafter_ensemble": 1, "target_verifier": 2}
_UNIT = 10_000  # Ray counts resources in 0.0001 units
_FIELDS = {"CPU": "num_cpus", "GPU": "num_gpus"}
_NOT_REQUESTABLE = ("memory", "object_store_memory")
_APPEAR_S = 120.0  # how long a deployed application may be missing from serve.status()


class StartupError(RuntimeError):
    """The application cannot start here; the message says which deployment, what it asks and what to change."""


@dataclass(frozen=True)
class ClusterResources:
    """What a Ray cluster has: its totals, what is free now, and each alive node's totals."""

    totals: dict[str, float]
    available: dict[str, float] = field(default_factory=dict)
    nodes: tuple[dict[str, float], ...] = ()

    @classmethod
    def from_ray(cls) -> ClusterResources:
        import ray

        nodes = tuple(dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive"))
        return cls(dict(ray.cluster_resources()), dict(ray.available_resources()), nodes)

    @classmethod
    def local(cls, num_cpus: float | None = None, num_gpus: float | None = None) -> ClusterResources:
        """What a local ``ray.init(num_cpus=..., num_gpus=...)`` on this machine will have, before it starts: the
        CPUs given, else those Ray counts here; the GPUs given, else unknown (``inf``: never a problem here, Ray's
        own count is checked once it runs)."""
        if num_cpus is None:
            try:
                import ray._private.utils as ray_utils

                num_cpus = float(ray_utils.get_num_cpus())  # Ray's own count (cgroup quotas included)
            except Exception:  # noqa: BLE001 (a Ray without it: the CPUs this process may use)
                num_cpus = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                                 os.cpu_count() or 1)
        node = {"CPU": float(num_cpus), "GPU": math.inf if num_gpus is None else float(num_gpus)}
        return cls(dict(node), dict(node), (dict(node),))

    def largest(self, resource: str) -> float:
        return max((n.get(resource, 0.0) for n in self.nodes), default=self.totals.get(resource, 0.0))

    def describe(self) -> str:
        known = {r: v for r, v in _requestable(self.totals).items() if not math.isinf(v)}
        totals, free = known, {r: v for r, v in _requestable(self.available).items() if r in known}
        text = f"{_fmt(totals)} in all on {len(self.nodes) or 1} node(s)"
        return text if not self.available or free == totals else f"{text}, {_fmt(free)} free now"


def deployed(cfg: SpeculaConfig) -> list[str]:
    """The config keys of the deployments the application runs (no DrafterEnsemble with drafter.gamma 0 or a
    drafter colocated with the verifier; no VisionEncoder with vision_encoder.colocate; no TargetVerifier with
    target_verifier.in_ingress)."""
    d = cfg.deployments
    skip = set()
    if not (cfg.drafter.gamma > 0 and cfg.drafter.colocate is not True):
        skip.add("drafter_ensemble")
    if d.vision_encoder.colocate is True:
        skip.add("vision_encoder")
    if d.target_verifier.in_ingress is True:
        skip.add("target_verifier")
    return [k for k in DEPLOYMENTS if k not in skip]


def colocates(cfg: SpeculaConfig, cluster: ClusterResources) -> bool:
    """``drafter.colocate``, or where it is null: whether the drafter and the verifier both run on the CPU of a
    one-node cluster (then a DrafterEnsemble process would only add hand-offs and compete for the same cores)."""
    if cfg.drafter.colocate is not None:
        return cfg.drafter.colocate
    return _one_cpu_node(cfg.deployments.drafter_ensemble.device, cfg, cluster)


def vision_colocates(cfg: SpeculaConfig, cluster: ClusterResources) -> bool:
    """``deployments.vision_encoder.colocate``, or where it is null: whether the vision encoder and the verifier both
    run on the CPU of a one-node cluster (then the verifier's own tower saves a hop per image request)."""
    if cfg.deployments.vision_encoder.colocate is not None:
        return cfg.deployments.vision_encoder.colocate
    return _one_cpu_node(cfg.deployments.vision_encoder.device, cfg, cluster)


def verifier_in_ingress(cfg: SpeculaConfig, cluster: ClusterResources) -> bool:
    """``deployments.target_verifier.in_ingress``, or where it is null: whether one verifier on the CPU of a one-node
    cluster (one replica, no autoscaling, no reservation of its own asked) serves; then running its engine inside the ingress replica saves a Ray call
    and a Ray stream per request, both of which cost CPU the decode loop needs on a small machine."""
    v = cfg.deployments.target_verifier
    if v.in_ingress is not None:
        return v.in_ingress
    single = v.num_replicas == 1 and v.autoscaling_config is None
    unreserved = v.ray_actor_options.num_cpus is None and not v.ray_actor_options.num_gpus  # nothing asked of Ray
    return single and unreserved and _one_cpu_node(v.device, cfg, cluster)


def _one_cpu_node(device: str, cfg: SpeculaConfig, cluster: ClusterResources) -> bool:
    return device == "cpu" and cfg.deployments.target_verifier.device == "cpu" and len(cluster.nodes) <= 1


def resolve_colocation(cfg: SpeculaConfig, cluster: ClusterResources | None = None) -> SpeculaConfig:
    """``cfg`` with ``drafter.colocate``, ``deployments.vision_encoder.colocate`` and
    ``deployments.target_verifier.in_ingress`` decided (``colocates``, ``vision_colocates``,
    ``verifier_in_ingress``), so every replica reads the same answer."""
    d = cfg.deployments
    if None not in (cfg.drafter.colocate, d.vision_encoder.colocate, d.target_verifier.in_ingress):
        return cfg
    cluster = cluster if cluster is not None else _current_cluster()
    raw = cfg.model_dump(mode="json")
    raw["drafter"]["colocate"] = colocates(cfg, cluster)
    raw["deployments"]["vision_encoder"]["colocate"] = vision_colocates(cfg, cluster)
    raw["deployments"]["target_verifier"]["in_ingress"] = verifier_in_ingress(cfg, cluster)
    return load_config(raw)


def size_reservations(cfg: SpeculaConfig, cluster: ClusterResources | None = None) -> SpeculaConfig:
    """``cfg`` with ``drafter.colocate`` decided and every null ``num_cpus`` of a deployed deployment sized from
    ``cluster`` (see the module doc), the verifier's torch threads with them; a config with none null is returned
    as is. ``cluster`` defaults to Ray's (when connected), else this machine's."""
    if cluster is None:
        cluster = _current_cluster()
    cfg = resolve_colocation(cfg, cluster)
    d = cfg.deployments
    keys = deployed(cfg)
    auto = [k for k in keys if getattr(d, k).ray_actor_options.num_cpus is None]
    hosted_threads = d.target_verifier.in_ingress and d.target_verifier.torch_threads is None
    if not auto and not hosted_threads:
        return cfg
    explicit = sum(_units(getattr(d, k).ray_actor_options.num_cpus) * getattr(d, k).replicas_at_most()
                   for k in keys if k not in auto)
    budget = max(0, _units(cluster.totals.get("CPU", 0.0)) - explicit)
    weights = dict(WEIGHTS)
    if d.target_verifier.in_ingress:  # the ingress replica decodes too
        weights["ingress"] += WEIGHTS["target_verifier"]
    shares = sum(weights[k] * getattr(d, k).replicas_at_most() for k in auto)
    largest = _units(cluster.largest("CPU"))
    raw = cfg.model_dump(mode="json")
    for k in auto:
        share = budget * weights[k] // shares if shares else 0
        share = min(share, largest)
        if share >= _UNIT:
            share -= share % _UNIT  # whole CPUs above one: whole torch threads, no CPU half shared
        raw["deployments"][k]["ray_actor_options"]["num_cpus"] = share / _UNIT
    sized = load_config(raw)
    # a verifier in the ingress decodes on the node's CPUs whatever the ingress reserved
    if ("target_verifier" in auto and d.target_verifier.torch_threads is None) or hosted_threads:
        raw["deployments"]["target_verifier"]["torch_threads"] = verifier_threads(sized, cluster)
        sized = load_config(raw)
    return sized


def verifier_threads(cfg: SpeculaConfig, cluster: ClusterResources) -> int:
    """Torch threads of a verifier replica whose CPUs were sized here: decoding is the verifier's work (the ingress
    and the vision encoder compute in short bursts), so it takes the node's whole CPUs, less the threads of a
    DrafterEnsemble replica on the same CPUs, which drafts while it verifies. Reservations stay as sized (they only
    place replicas); one verifier replica per node is what they allow on a small machine."""
    node = int(cluster.largest("CPU")) if not math.isinf(cluster.largest("CPU")) else 1
    drafter = 0
    if "drafter_ensemble" in deployed(cfg) and cfg.deployments.drafter_ensemble.device == "cpu":
        drafter = cfg.deployments.drafter_ensemble.threads() or 1
    return max(1, node - drafter)


def request(settings: DeploymentSettings) -> dict[str, float]:
    """What one replica asks Ray for (resources with a non-zero amount)."""
    opts = settings.ray_actor_options
    asked = {"CPU": opts.num_cpus if opts.num_cpus is not None else 1.0, "GPU": opts.num_gpus}
    return {r: v for r, v in asked.items() if v > 0}


def placement_problems(cfg: SpeculaConfig, cluster: ClusterResources) -> list[str]:
    """Why the application's replicas cannot all be placed on ``cluster`` as it is (empty: they fit). Counts the
    replicas Serve starts with (num_replicas, or autoscaling_config.min_replicas)."""
    d = cfg.deployments
    problems, too_big = [], set()
    for k in deployed(cfg):
        s = getattr(d, k)
        for r, v in request(s).items():
            if math.isinf(cluster.largest(r)):
                continue  # not known yet
            if _units(v) > _units(cluster.largest(r)):
                too_big.add(r)
                problems.append(
                    f"{_who(k)} asks {_fmt({r: v})} per replica, more than any node has (the largest has "
                    f"{_fmt({r: cluster.largest(r)})}): lower deployments.{k}.ray_actor_options.{_FIELDS[r]}"
                    f"{_null_hint(r)}, or give Ray a node with {_fmt({r: v})}")
    for r in sorted({r for k in deployed(cfg) for r in request(getattr(d, k))} - too_big):
        asks = {k: (request(getattr(d, k)).get(r, 0.0), _start_replicas(getattr(d, k))) for k in deployed(cfg)}
        asks = {k: a for k, a in asks.items() if a[0] > 0 and a[1] > 0}
        total = sum(_units(v) * n for v, n in asks.values())
        if not math.isinf(cluster.totals.get(r, 0.0)) and total > _units(cluster.totals.get(r, 0.0)):
            parts = ", ".join(f"{_who(k)} {v:g} x {n} (deployments.{k}.ray_actor_options.{_FIELDS[r]})"
                              for k, (v, n) in asks.items())
            problems.append(
                f"the deployments ask {_fmt({r: total / _UNIT})} in all, more than the cluster's "
                f"{_fmt({r: cluster.totals.get(r, 0.0)})}: {parts}; lower those fields{_null_hint(r)} or the "
                "replica counts, or give the cluster more")
    return problems


def placement_message(cfg: SpeculaConfig, cluster: ClusterResources, problems: list[str],
                      where: str = "this Ray cluster") -> str:
    lines = [f"specula: cannot place application {cfg.name!r} on {where} ({cluster.describe()}):"]
    return "\n".join(lines + [f"  - {p}" for p in problems])


def watch_startup(cfg: SpeculaConfig, placement_timeout_s: float | None, *,
                  status: Callable[[], object] | None = None,
                  cluster: Callable[[], ClusterResources] | None = None,
                  poll_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait until application ``cfg.name`` is RUNNING (``serve.status()``); ``StartupError`` if it fails to deploy,
    or if a replica Serve reports waiting for resources ("to be scheduled") still waits ``placement_timeout_s``
    after the start (None: wait as long as it takes). Replicas that are placed and initializing (loading a model)
    are never timed out here."""
    if status is None:
        from ray import serve

        status = serve.status
    cluster = cluster or ClusterResources.from_ray
    start = clock()
    while True:
        app = status().applications.get(cfg.name)
        if app is None and clock() - start > _APPEAR_S:
            raise StartupError(f"specula: Serve shows no application {cfg.name!r} {_APPEAR_S:.0f} s after it was "
                               "deployed (serve.status() lists none by that name)")
        state = _state(getattr(app, "status", ""))
        if state == "RUNNING":
            return
        if state == "DEPLOY_FAILED":
            raise StartupError(_failed_message(cfg, app))
        waiting = {name: dep for name, dep in (app.deployments.items() if app is not None else ())
                   if "to be scheduled" in (getattr(dep, "message", "") or "")}
        elapsed = clock() - start
        if waiting and placement_timeout_s is not None and elapsed >= placement_timeout_s:
            raise StartupError(_unplaced_message(cfg, waiting, cluster(), elapsed))
        sleep(poll_s)


# ----------------------------------------------------------------------------------------------- helpers


def _current_cluster() -> ClusterResources:
    import ray

    return ClusterResources.from_ray() if ray.is_initialized() else ClusterResources.local()


def _unplaced_message(cfg: SpeculaConfig, waiting: dict, cluster: ClusterResources, elapsed: float) -> str:
    keys = {v: k for k, v in DEPLOYMENTS.items()}
    lines = [f"specula: Serve could not place application {cfg.name!r} within {elapsed:.0f} s; this Ray cluster has "
             f"{cluster.describe()}:"]
    for name, dep in waiting.items():
        k = keys.get(name)
        if k is None:
            lines.append(f"  - {name}: {dep.message}")
            continue
        s = getattr(cfg.deployments, k)
        fields = ", ".join(f"deployments.{k}.ray_actor_options.{_FIELDS[r]}" for r in request(s))
        lines.append(f"  - {_who(k)} waits for resources: each replica asks {_fmt(request(s))}; change "
                     f"{fields or f'deployments.{k}.ray_actor_options'} (null num_cpus sizes it from the cluster) or "
                     f"add nodes that have it. Serve says: {dep.message}")
    return "\n".join(lines)


def _failed_message(cfg: SpeculaConfig, app) -> str:
    lines = [f"specula: application {cfg.name!r} failed to deploy: {getattr(app, 'message', '')}".rstrip()]
    for name, dep in getattr(app, "deployments", {}).items():
        if _state(getattr(dep, "status", "")) != "HEALTHY" and getattr(dep, "message", ""):
            lines.append(f"  - {name}: {dep.message}")
    return "\n".join(lines)


def _state(status) -> str:
    """A Serve status enum (or its string) as its bare name: "RUNNING", "DEPLOY_FAILED", "HEALTHY", ..."""
    return str(getattr(status, "value", status)).rpartition(".")[2]


def _start_replicas(s: DeploymentSettings) -> int:
    return s.num_replicas if s.autoscaling_config is None else s.autoscaling_config.min_replicas


def _who(key: str) -> str:
    return f"{DEPLOYMENTS[key]} (deployments.{key})"


def _null_hint(resource: str) -> str:
    return " (null sizes num_cpus from the cluster)" if resource == "CPU" else ""


def _units(x: float | None) -> int:
    return math.floor((x or 0.0) * _UNIT + 1e-6)


def _requestable(resources: dict[str, float]) -> dict[str, float]:
    out = {"CPU": resources.get("CPU", 0.0), "GPU": resources.get("GPU", 0.0)}
    out.update({r: v for r, v in resources.items() if r not in out and not r.startswith(("node:", "accelerator_type"))
                and r not in _NOT_REQUESTABLE})
    return out


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{'?' if math.isinf(v) else f'{v:g}'} {r}" for r, v in resources.items()) or "nothing"
