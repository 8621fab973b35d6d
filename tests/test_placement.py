"""Placement on a real multi-node Ray (``ray.cluster_utils.Cluster``): two CPU hosts and one
host declaring ``NPU: 2``. No real NPU exists, so learners compute on CPU while being placed
by the NPU resource (``learner.placement_resource: NPU``)."""

import pytest
import ray

from cluster import config as config_mod
from cluster import placement
from cluster.driver import Trainer
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def three_node_cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # the shared local Ray; ray_local starts it again for later tests
    cluster = Cluster()
    cpu_a = cluster.add_node(num_cpus=2)  # the first node added is the head
    cpu_b = cluster.add_node(num_cpus=2)
    npu = cluster.add_node(num_cpus=2, resources={"NPU": 2})
    ray.init(address=cluster.address, namespace="ascent_rl_placement", log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield {"cpu": {cpu_a.node_id, cpu_b.node_id}, "npu": npu.node_id}
    finally:
        ray.shutdown()
        cluster.shutdown()


def cfg_for(*extra):
    return config_mod.load(str(ROOT / "configs/cartpole.yaml"), [
        "learner.device=cpu", "learner.placement_resource=NPU", "learner.num_learners=2",
        "rollout.num_actors=2", "rollout.envs_per_actor=8", "replay.num_shards=2",
        "run.total_env_steps=4096", "run.target_return=null", "run.require_target=false", *extra,
    ])


def test_every_actor_lands_where_the_config_says(three_node_cluster, tmp_path):
    nodes = three_node_cluster
    trainer = Trainer(cfg_for(), tmp_path / "run", quiet=True)
    try:
        trainer.build()
        where = trainer.placement_report()
        assert where["learners"] == [nodes["npu"], nodes["npu"]]
        assert set(where["rollouts"]) == nodes["cpu"], "rollout actors must spread over both CPU hosts"
        # Each shard sits with its producer, so adds never cross the network.
        assert where["shards"] == where["rollouts"]
        assert where["board"] in nodes["cpu"]
        # And the placed graph really trains: two gloo learners across the NPU host's bundles.
        result = trainer.run()
        assert result.iterations >= 3
    finally:
        trainer.shutdown()


def test_missing_npu_capacity_is_one_clear_error_before_anything_starts(three_node_cluster, tmp_path):
    cfg = cfg_for("learner.num_learners=4", "learner.batch_size=2048", "learner.minibatch_size=512",
                  "rollout.envs_per_actor=8", "rollout.num_actors=2")
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    with pytest.raises(placement.ResourceError) as err:
        trainer.build()
    assert str(err.value) == "the Ray cluster has 2 NPU but learner.num_learners = 4 needs 4 NPU"
    assert trainer.learners == [] and trainer.rollouts == []


def test_rollouts_that_do_not_fit_on_cpu_hosts_are_refused(three_node_cluster, tmp_path):
    cfg = cfg_for("rollout.num_actors=5", "replay.num_shards=1", "learner.num_cpus=0.5")  # 6 CPU in total: enough
    with pytest.raises(placement.ResourceError, match=r"CPU hosts have 4 CPU in all but rollout.num_actors = 5"):
        placement.plan(cfg)

