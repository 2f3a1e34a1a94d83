import pytest
import torch

from tensorfleet.cluster.placement import (GreedyByBytes, RoundRobin, RowPartitioner, VariableInfo, place,
                                           ps_device_name)
from tensorfleet.errors import ClusterSpecError


def infos(*shapes):
    return [VariableInfo(f"v{i}", shape, "float32") for i, shape in enumerate(shapes)]


def test_round_robin_in_creation_order():
    assert place(infos((2,), (2,), (2,)), 2).shard_map() == {"v0": 0, "v1": 1, "v2": 0}


def test_greedy_by_bytes_goes_to_least_loaded_with_ties_to_lowest():
    # 400 B, 40 B, 40 B, 40 B: round robin would put 440 B on ps 0; greedy balances by bytes.
    variables = infos((100,), (10,), (10,), (10,))
    assert place(variables, 2, strategy=GreedyByBytes()).shard_map() == {"v0": 0, "v1": 1, "v2": 1, "v3": 1}
    assert place(variables, 2, strategy=GreedyByBytes()).bytes_per_shard(2) == [400, 120]
    assert place(variables, 2, strategy=RoundRobin()).bytes_per_shard(2) == [440, 80]


def test_row_ranges_give_extra_rows_to_the_first_parts():
    assert RowPartitioner(num_parts=3).row_ranges(10) == [(0, 4), (4, 7), (7, 10)]
    assert RowPartitioner(num_parts=4).row_ranges(2) == [(0, 1), (1, 2)]  # never an empty part


def test_partitioned_parts_round_robin_and_small_variables_stay_whole():
    variables = [VariableInfo("emb", (10, 4), "float32"), VariableInfo("bias", (4,), "float32")]
    placement = place(variables, 2, partitioner=RowPartitioner(num_parts=3, min_bytes=64))
    assert placement.shard_map() == {"emb/part_0": 0, "emb/part_1": 1, "emb/part_2": 0, "bias": 1}
    assert [p.rows for p in placement.parts] == [(0, 4), (4, 7), (7, 10), None]
    assert placement.describe().splitlines()[1] == "emb/part_1: /job:ps/replica:0/task:1/device:CPU:0"


def test_views_split_and_reassemble_without_copy():
    placement = place([VariableInfo("w", (5, 3), "float32")], 2, partitioner=RowPartitioner(num_parts=2))
    weight = torch.arange(15.0).reshape(5, 3)
    views = placement.views({"w": weight})
    assert [tuple(v.shape) for v in views.values()] == [(3, 3), (2, 3)]
    assert torch.equal(torch.cat(list(views.values())), weight)
    views["w/part_1"].fill_(-1)  # a view: writing into a part writes into the variable
    assert torch.equal(weight[3:], torch.full((2, 3), -1.0))


def test_placement_is_a_pure_function_of_variables_and_cluster():
    variables = infos((7, 3), (3,), (100, 2), (1,))
    for strategy in (RoundRobin(), GreedyByBytes()):
        a = place(variables, 3, strategy=strategy, partitioner=RowPartitioner(2, min_bytes=100))
        b = place(list(variables), 3, strategy=strategy, partitioner=RowPartitioner(2, min_bytes=100))
        assert a == b


def test_placement_needs_a_ps():
    with pytest.raises(ClusterSpecError, match="no ps task"):
        place(infos((1,)), 0)


def test_device_name():
    assert ps_device_name(1) == "/job:ps/replica:0/task:1/device:CPU:0"
