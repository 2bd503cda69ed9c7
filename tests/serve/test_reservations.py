"""CPU reservations sized from the cluster (a null ``num_cpus``), the check that an application fits a cluster, and
the startup watchdog's decisions, without Ray: the cluster and Serve's status are given as plain objects."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from specula.runtime.config import load_config
from specula.runtime.serve.placement import (ClusterResources, StartupError, placement_message, placement_problems,
                                             size_reservations, watch_startup)

KEYS = ("ingress", "vision_encoder", "drafter_ensemble", "target_verifier")


def _cpus(cfg) -> dict[str, float | None]:
    return {k: getattr(cfg.deployments, k).ray_actor_options.num_cpus for k in KEYS}


def _cluster(cpus: float, gpus: float = 0.0, nodes: int = 1) -> ClusterResources:
    node = {"CPU": cpus / nodes, "GPU": gpus / nodes, "memory": 1e9, "node:127.0.0.1": 1.0}
    return ClusterResources({"CPU": cpus, "GPU": gpus, "memory": 1e9 * nodes}, {"CPU": cpus, "GPU": gpus},
                            tuple(dict(node) for _ in range(nodes)))


def test_the_default_reserves_nothing_until_sized():
    cfg = load_config({})
    assert set(_cpus(cfg).values()) == {None}
    assert cfg.deployments.target_verifier.threads() is None  # torch's default outside Serve
    assert "num_cpus" not in cfg.deployments.ingress.serve_options()["ray_actor_options"]


# a DrafterEnsemble, a VisionEncoder and a TargetVerifier beside the ingress (the default on GPUs, clusters)
SEPARATE = {"drafter": {"colocate": False}, "deployments": {"vision_encoder": {"colocate": False},
                                                           "target_verifier": {"in_ingress": False}}}


def _separate(**deployments) -> dict:
    """SEPARATE with these deployment sections (their fields beside SEPARATE's)."""
    out = {k: dict(v) for k, v in SEPARATE["deployments"].items()}
    for k, v in deployments.items():
        out[k] = {**out.get(k, {}), **v}
    return {**SEPARATE, "deployments": out}


@pytest.mark.parametrize("cpus, want, verifier_threads", [
    (2, {"ingress": 0.4, "vision_encoder": 0.4, "drafter_ensemble": 0.4, "target_verifier": 0.8}, 1),
    (1, {"ingress": 0.2, "vision_encoder": 0.2, "drafter_ensemble": 0.2, "target_verifier": 0.4}, 1),
    (8, {"ingress": 1.0, "vision_encoder": 1.0, "drafter_ensemble": 1.0, "target_verifier": 3.0}, 7),
    (3, {"ingress": 0.6, "vision_encoder": 0.6, "drafter_ensemble": 0.6, "target_verifier": 1.0}, 2),
])
def test_default_reservations_share_the_cluster_and_always_fit(cpus, want, verifier_threads):
    sized = size_reservations(load_config(SEPARATE), _cluster(cpus))
    assert _cpus(sized) == want
    assert sum(want.values()) <= cpus
    assert placement_problems(sized, _cluster(cpus)) == []
    for k in ("ingress", "vision_encoder", "drafter_ensemble"):  # torch threads follow the reservation
        assert getattr(sized.deployments, k).threads() == max(1, int(want[k]))
    # the verifier decodes: the node's CPUs less the drafter's thread, so the two never oversubscribe it
    assert sized.deployments.target_verifier.threads() == verifier_threads
    assert size_reservations(sized, _cluster(64)) is sized  # sized once: nothing null is left


@pytest.mark.parametrize("cpus, threads", [(2, 2), (1, 1), (8, 8)])
def test_the_default_on_one_cpu_node_is_one_ingress_replica_that_verifies_drafts_and_encodes_on_every_core(
        cpus, threads):
    sized = size_reservations(load_config({}), _cluster(cpus))
    d = sized.deployments
    assert sized.drafter.colocate is True and d.vision_encoder.colocate is True and d.target_verifier.in_ingress
    assert _cpus(sized) == {"ingress": float(cpus), "vision_encoder": None, "drafter_ensemble": None,
                            "target_verifier": None}
    assert d.target_verifier.threads() == threads  # the verifier's engine in the ingress: every core
    assert placement_problems(sized, _cluster(cpus)) == []
    # an ingress reservation given by hand (the drafter's sized) leaves the verifier inside it every core too
    given = size_reservations(load_config({"deployments": {"ingress": {"ray_actor_options": {"num_cpus": 0.5}}}}),
                              _cluster(cpus))
    assert given.deployments.target_verifier.in_ingress and given.deployments.target_verifier.threads() == threads


@pytest.mark.parametrize("cpus, want, threads", [(2, (0.6666, 1.0), 2), (1, (0.3333, 0.6666), 1),
                                                  (8, (2.0, 5.0), 8)])
def test_a_verifier_of_its_own_on_one_cpu_node_drafts_and_encodes_and_takes_every_core(cpus, want, threads):
    sized = size_reservations(load_config({"deployments": {"target_verifier": {"in_ingress": False}}}), _cluster(cpus))
    assert sized.drafter.colocate is True and sized.deployments.vision_encoder.colocate is True
    assert _cpus(sized) == {"ingress": want[0], "vision_encoder": None, "drafter_ensemble": None,
                            "target_verifier": want[1]}
    assert sized.deployments.target_verifier.threads() == threads
    assert placement_problems(sized, _cluster(cpus)) == []


def test_the_verifier_leaves_the_ingress_when_it_scales_sits_on_a_gpu_or_the_cluster_has_nodes():
    scaled = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}
    for raw, cluster in (({"deployments": {"target_verifier": scaled}}, _cluster(4)),
                         ({"deployments": {"target_verifier": {"num_replicas": 2}}}, _cluster(4)),
                         ({}, _cluster(16, nodes=8)),
                         ({"deployments": {"target_verifier": {"device": "cuda", "ray_actor_options": {
                             "num_gpus": 1}}}}, _cluster(8, gpus=1))):
        assert size_reservations(load_config(raw), cluster).deployments.target_verifier.in_ingress is False, raw
    assert size_reservations(load_config({"deployments": {"target_verifier": {"in_ingress": True}}}),
                             _cluster(16, nodes=8)).deployments.target_verifier.in_ingress is True
    with pytest.raises(ValueError, match="in_ingress: true runs the verifier on the ingress replica's CPU"):
        load_config({"deployments": {"target_verifier": {"in_ingress": True, "device": "cuda",
                                                         "ray_actor_options": {"num_gpus": 1}}}})


def test_gpus_or_several_nodes_keep_the_drafter_and_the_vision_encoder_apart():
    gpu = {"device": "cuda", "ray_actor_options": {"num_gpus": 1}}
    on_gpus = load_config({"deployments": {"drafter_ensemble": gpu, "target_verifier": gpu}})
    assert size_reservations(on_gpus, _cluster(8, gpus=2)).drafter.colocate is False
    assert size_reservations(load_config({}), _cluster(16, nodes=8)).drafter.colocate is False
    assert size_reservations(load_config({"drafter": {"colocate": True}}), _cluster(16, nodes=8)).drafter.colocate
    vision = {"device": "cuda", "ray_actor_options": {"num_gpus": 1}}
    on_gpus = load_config({"deployments": {"vision_encoder": vision, "target_verifier": gpu}})
    assert size_reservations(on_gpus, _cluster(8, gpus=2)).deployments.vision_encoder.colocate is False
    assert size_reservations(load_config({}), _cluster(16, nodes=8)).deployments.vision_encoder.colocate is False


def test_explicit_reservations_are_honoured_and_the_rest_share_what_is_left():
    cfg = load_config(_separate(target_verifier={"ray_actor_options": {"num_cpus": 1}, "torch_threads": 2},
                                ingress={"ray_actor_options": {"num_cpus": 0}}))
    sized = size_reservations(cfg, _cluster(2))
    assert _cpus(sized) == {"ingress": 0.0, "vision_encoder": 0.5, "drafter_ensemble": 0.5, "target_verifier": 1.0}
    assert sized.deployments.target_verifier.threads() == 2 and sized.deployments.ingress.threads() == 1
    # explicit reservations beyond the cluster leave nothing to share; the check then says what does not fit
    over = size_reservations(load_config(_separate(target_verifier={"ray_actor_options": {"num_cpus": 4}})),
                             _cluster(2))
    assert _cpus(over) == {"ingress": 0.0, "vision_encoder": 0.0, "drafter_ensemble": 0.0, "target_verifier": 4.0}


def test_sizing_counts_autoscaled_replicas_at_their_most_and_skips_an_absent_drafter():
    cfg = load_config({"drafter": {"gamma": 0}, "deployments": {
        "vision_encoder": {"colocate": False},
        "target_verifier": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}}})
    sized = size_reservations(cfg, _cluster(4))
    got = _cpus(sized)
    assert got["drafter_ensemble"] is None  # not deployed with gamma 0
    assert got == {"ingress": 0.5, "vision_encoder": 0.5, "drafter_ensemble": None, "target_verifier": 1.0}
    assert got["ingress"] + got["vision_encoder"] + 3 * got["target_verifier"] <= 4


def test_no_replica_is_sized_beyond_the_largest_node():
    sized = size_reservations(load_config({}), _cluster(16, nodes=8))  # eight 2-CPU nodes
    assert max(_cpus(sized).values()) <= 2


@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")  # Ray's own pydantic use
def test_the_builder_ships_the_sized_reservations_to_serve_and_to_the_replicas():
    from specula.runtime.serve.builder import build_app

    ingress = build_app(SEPARATE, cluster=_cluster(2))._bound_deployment
    assert ingress.ray_actor_options["num_cpus"] == 0.4
    shipped = ingress.init_args[0]["deployments"]
    assert {k: shipped[k]["ray_actor_options"]["num_cpus"] for k in KEYS} == {
        "ingress": 0.4, "vision_encoder": 0.4, "drafter_ensemble": 0.4, "target_verifier": 0.8}
    # the default: drafter and vision in the verifier, the verifier in the ingress, decided once here and shipped
    ingress = build_app({}, cluster=_cluster(2))._bound_deployment
    shipped = ingress.init_args[0]
    assert shipped["drafter"]["colocate"] is True and shipped["deployments"]["target_verifier"]["torch_threads"] == 2
    assert shipped["deployments"]["vision_encoder"]["colocate"] is True
    assert shipped["deployments"]["target_verifier"]["in_ingress"] is True
    assert ingress.ray_actor_options["num_cpus"] == 2.0
    assert ingress.init_args[1] is None  # no VisionEncoder: the verifier encodes the images
    assert ingress.init_args[2] is None and ingress.init_kwargs["drafter"] is None  # no TargetVerifier, no drafter
    # a verifier of its own: the TargetVerifier bound with no DrafterEnsemble
    ingress = build_app({"deployments": {"target_verifier": {"in_ingress": False}}}, cluster=_cluster(2))
    verifier = ingress._bound_deployment.init_args[2]._bound_deployment
    assert verifier.init_args[1] is None


def test_cluster_yaml_reservations_are_explicit_and_kept():
    cluster = yaml.safe_load((Path(__file__).resolve().parents[2] / "cluster.yaml").read_text())
    cfg = load_config(cluster["metadata"]["specula_serve_config"]["applications"][0]["args"])
    assert None not in _cpus(cfg).values()
    assert size_reservations(cfg, _cluster(8)) is cfg


def test_a_replica_bigger_than_any_node_is_named_with_its_field():
    cfg = size_reservations(load_config({"deployments": {"target_verifier": {"ray_actor_options": {"num_cpus": 4}}}}),
                            _cluster(2))
    problems = placement_problems(cfg, _cluster(2))
    assert len(problems) == 1
    (p,) = problems
    assert "TargetVerifier (deployments.target_verifier) asks 4 CPU per replica" in p
    assert "the largest has 2 CPU" in p and "deployments.target_verifier.ray_actor_options.num_cpus" in p
    msg = placement_message(cfg, _cluster(2), problems)
    assert msg.startswith("specula: cannot place application 'specula' on this Ray cluster (2 CPU, 0 GPU in all")


def test_replicas_that_do_not_fit_together_are_all_named():
    one = {"ray_actor_options": {"num_cpus": 1}}
    cfg = load_config({**SEPARATE, "deployments": {k: one for k in KEYS}})
    (p,) = placement_problems(cfg, _cluster(2))
    assert "the deployments ask 4 CPU in all, more than the cluster's 2 CPU" in p
    for k in KEYS:
        assert f"deployments.{k}.ray_actor_options.num_cpus" in p


def test_a_gpu_device_without_a_gpu_names_num_gpus():
    gpu = {"device": "cuda", "ray_actor_options": {"num_gpus": 1}}
    cfg = size_reservations(load_config({"deployments": {"target_verifier": gpu}}), _cluster(8))
    (p,) = placement_problems(cfg, _cluster(8))
    assert "TargetVerifier" in p and "1 GPU per replica" in p and "ray_actor_options.num_gpus" in p
    assert placement_problems(cfg, _cluster(8, gpus=1)) == []


# ----------------------------------------------------------------------------------------------- the watchdog


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def _status(app_status: str, **deployments: tuple[str, str]):
    deps = {name: SimpleNamespace(status=st, message=msg) for name, (st, msg) in deployments.items()}
    app = SimpleNamespace(status=app_status, message="", deployments=deps)
    return SimpleNamespace(applications={"specula": app})


_WAITING = ("UPDATING", "Deployment 'TargetVerifier' in application 'specula' has 1 replicas that have taken more "
                        "than 30s to be scheduled. ... Resources required for each replica: {\"CPU\": 4.0}")
_LOADING = ("UPDATING", "Deployment 'TargetVerifier' in application 'specula' has 1 replicas that have taken more "
                        "than 30s to initialize.")


def _watch(cfg, statuses, timeout):
    clock, seen = _Clock(), []

    def status():
        seen.append(clock.t)
        return statuses(clock.t)

    watch_startup(cfg, timeout, status=status, cluster=lambda: _cluster(2), poll_s=1.0, clock=clock,
                  sleep=clock.sleep)
    return seen


def test_the_watchdog_returns_once_the_application_runs():
    cfg = load_config({})
    seen = _watch(cfg, lambda t: _status("RUNNING" if t >= 5 else "DEPLOYING", TargetVerifier=_LOADING), 30)
    assert seen[-1] == 5


def test_a_replica_that_cannot_be_placed_ends_the_start_naming_it():
    cfg = size_reservations(load_config({"deployments": {"target_verifier": {"ray_actor_options": {"num_cpus": 4}}}}),
                            _cluster(2))
    statuses = lambda t: _status("DEPLOYING", TargetVerifier=_WAITING if t >= 30 else ("UPDATING", ""),  # noqa: E731
                                 Ingress=("HEALTHY", ""))
    with pytest.raises(StartupError) as e:
        _watch(cfg, statuses, 45)
    msg = str(e.value)
    assert "could not place application 'specula' within 45 s" in msg and "2 CPU, 0 GPU in all" in msg
    assert "TargetVerifier (deployments.target_verifier) waits for resources: each replica asks 4 CPU" in msg
    assert "change deployments.target_verifier.ray_actor_options.num_cpus" in msg and "to be scheduled" in msg
    assert "Ingress" not in msg.replace("deployments.ingress", "")


def test_replicas_loading_a_model_are_never_timed_out_and_a_failed_deploy_is_reported():
    cfg = load_config({})
    seen = _watch(cfg, lambda t: _status("RUNNING" if t >= 300 else "DEPLOYING", TargetVerifier=_LOADING), 45)
    assert seen[-1] == 300
    seen = _watch(cfg, lambda t: _status("RUNNING" if t >= 200 else "DEPLOYING", TargetVerifier=_WAITING), None)
    assert seen[-1] == 200  # no timeout: waits as long as it takes
    failed = lambda t: _status("DEPLOY_FAILED", TargetVerifier=("DEPLOY_FAILED", "__init__ raised OSError"))  # noqa
    with pytest.raises(StartupError, match=r"failed to deploy(.|\n)*TargetVerifier: __init__ raised OSError"):
        _watch(cfg, failed, 45)


def test_an_application_serve_never_shows_ends_the_wait():
    empty = SimpleNamespace(applications={})
    with pytest.raises(StartupError, match="Serve shows no application 'specula'"):
        _watch(load_config({}), lambda t: empty, None)
