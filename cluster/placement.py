"""Ray start-up, device choice for learners, and resource checks before anything starts."""

from __future__ import annotations

import math
import os

import ray

from cluster.config import Config
from learner import device as devices


class ResourceError(RuntimeError):
    """The cluster cannot satisfy the config; the message names the resource and how much."""


def required_cpus(cfg: Config) -> float:
    return cfg.rollout.num_actors * cfg.rollout.num_cpus_per_actor + cfg.learner.num_learners * cfg.learner.num_cpus


def start_ray(cfg: Config, address: str | None) -> bool:
    """Join a cluster, or start an embedded one. Returns True if this process started Ray."""
    address = address or cfg.ray.address or os.environ.get("RAY_ADDRESS")
    # Quiet the worker logs' per-line prefixes a little; errors still reach the driver.
    if address:
        ray.init(address=address, namespace="ascent_rl", log_to_driver=True)
        return False
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(required_cpus(cfg)))
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=cfg.ray.include_dashboard,
        dashboard_host="127.0.0.1",
        namespace="ascent_rl",
        log_to_driver=True,
    )
    return True


def learner_device_kind(cfg: Config) -> str:
    """Explicit config wins; otherwise what the cluster offers: NPU, then GPU, then CPU."""
    if cfg.learner.device != "auto":
        return cfg.learner.device
    res = ray.cluster_resources()
    if res.get("NPU", 0) >= 1:
        return "npu"
    if res.get("GPU", 0) >= 1:
        return "cuda"
    return "cpu"


def learner_options(cfg: Config, kind: str) -> dict:
    spec = devices.spec_for(kind)
    opts: dict = {"num_cpus": cfg.learner.num_cpus}
    if spec.ray_resource == "GPU":
        opts["num_gpus"] = 1
    elif spec.ray_resource is not None:
        opts["resources"] = {spec.ray_resource: 1}
    return opts


def check_resources(cfg: Config, kind: str) -> None:
    """Fail before creating actors, instead of leaving them pending forever."""
    total = ray.cluster_resources()
    needs = [("CPU", required_cpus(cfg),
              "rollout.num_actors x rollout.num_cpus_per_actor + learner.num_learners x learner.num_cpus")]
    spec = devices.spec_for(kind)
    if spec.ray_resource is not None:
        needs.append((spec.ray_resource, cfg.learner.num_learners, f"learner.num_learners on device '{kind}'"))
    for key, amount, why in needs:
        have = total.get(key, 0)
        if have + 1e-9 < amount:
            raise ResourceError(f"the Ray cluster has {have:g} {key} but the config needs {amount:g} ({why})")
