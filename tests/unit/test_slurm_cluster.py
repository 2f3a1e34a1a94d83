"""A Slurm step's cluster from its environment: every rank computes the same one, roles by rank."""

from __future__ import annotations

import argparse

import pytest

from tensorfleet.cluster.slurm import expand_nodelist, expand_task_counts, slurm_cluster
from tensorfleet.cluster.flags import add_cluster_flags, cluster_from_flags
from tensorfleet.errors import ClusterSpecError


def step_env(rank: int, nodes: str = "gpu[01-02]", counts: str = "3(x2)", **more: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": counts,
            "SLURM_JOB_ID": "4242", **more}


@pytest.mark.parametrize(("text", "hosts"), [
    ("node1", ["node1"]),
    ("gpu[01-03,07],login5", ["gpu01", "gpu02", "gpu03", "gpu07", "login5"]),
    ("a[8-11]-ib", ["a8-ib", "a9-ib", "a10-ib", "a11-ib"]),
    ("rack[1-2]n,x[009-010]", ["rack1n", "rack2n", "x009", "x010"]),
])
def test_a_compressed_node_list_expands_as_slurm_writes_it(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-", "gpu[3-1]", "a,,b", "gpu[x]"])
def test_a_malformed_node_list_is_named(text):
    with pytest.raises(ClusterSpecError, match="malformed Slurm node list"):
        expand_nodelist(text)


def test_task_counts_expand_and_must_match_the_nodes():
    assert expand_task_counts("2(x3),1", 4) == [2, 2, 2, 1]
    with pytest.raises(ClusterSpecError, match="name 4 node"):
        expand_task_counts("2(x3),1", 3)


def test_every_rank_computes_the_same_cluster_and_knows_itself():
    port = 20000 + (4242 % 1250) * 32
    seen = [slurm_cluster(step_env(rank)) for rank in range(6)]
    assert all(cluster == seen[0][0] for cluster, _ in seen)
    cluster = seen[0][0]
    assert cluster.as_dict() == {"ps": [f"gpu01:{port}"],
                                 "worker": [f"gpu01:{port + 1}", f"gpu01:{port + 2}", f"gpu02:{port}",
                                            f"gpu02:{port + 1}", f"gpu02:{port + 2}"]}
    assert [task.short for _, task in seen] == ["ps:0", "worker:0", "worker:1", "worker:2", "worker:3", "worker:4"]
    assert cluster.chief.short == "worker:0"


def test_per_node_ps_and_a_cyclic_layout_and_a_given_port():
    env = step_env(3, counts="2(x2)", TENSORFLEET_SLURM_PS="per-node", SLURM_DISTRIBUTION="cyclic",
                   TENSORFLEET_SLURM_PORT="7000")
    cluster, task = slurm_cluster(env)
    # cyclic: rank 0 gpu01, 1 gpu02, 2 gpu01, 3 gpu02; the first rank of each node is a ps
    assert cluster.as_dict() == {"ps": ["gpu01:7000", "gpu02:7000"], "worker": ["gpu01:7001", "gpu02:7001"]}
    assert task.short == "worker:1"


@pytest.mark.parametrize(("env", "message"), [
    (step_env(0, counts="1(x2)", TENSORFLEET_SLURM_PS="2"), "none is left to train"),
    (step_env(0, TENSORFLEET_SLURM_PS="lots"), "give a number of ps"),
    (step_env(9), "SLURM_PROCID=9 is not a rank of this step's 6"),
    (step_env(0, SLURM_DISTRIBUTION="plane=2"), "only for block"),
    (step_env(0, TENSORFLEET_SLURM_PORT="80"), "TENSORFLEET_SLURM_PORT='80'"),
    (step_env(0, counts="40,2"), "set TENSORFLEET_SLURM_PORT"),
])
def test_a_step_that_cannot_be_a_cluster_says_why(env, message):
    with pytest.raises(ClusterSpecError, match=message):
        slurm_cluster(env)


def test_the_classic_flags_and_tf_config_win_over_slurm_and_the_flag_sets_the_ps():
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    env = step_env(1, counts="3,3")
    cluster, task = cluster_from_flags(parser.parse_args(["--slurm-ps", "2"]), env)
    assert cluster.num_tasks("ps") == 2 and task.short == "ps:1"
    flags = parser.parse_args(["--ps_hosts", "h:1", "--worker_hosts", "h:2", "--job_name", "worker",
                               "--task_index", "0"])
    assert cluster_from_flags(flags, env)[0].as_dict() == {"worker": ["h:2"], "ps": ["h:1"]}
    tf_config = '{"cluster": {"worker": ["w:1"], "ps": ["p:1"]}, "task": {"type": "ps", "index": 0}}'
    assert cluster_from_flags(parser.parse_args([]), {**env, "TF_CONFIG": tf_config})[1].short == "ps:0"
