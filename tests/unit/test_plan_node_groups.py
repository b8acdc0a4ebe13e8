"""Groups of consecutive ranks that straddle a node boundary: tensor parallelism is
refused there (it is placed within a node), other groups talk over the network."""


from partita.layout import Layout
from partita.layout_rules import CONSTRAINT
from partita.planner import Cluster, evaluate_layout, get_gpu, make_request, search
from partita.planner.search import SearchSpace
from partita.planner.timing import _link


def test_cluster_knows_which_spans_straddle_nodes():
    six = Cluster(get_gpu("H100"), 12, 6)
    assert [s for s in range(1, 13) if six.within_node(s)] == [1, 2, 3, 6]
    h100 = get_gpu("H100")
    assert six.link(4) == (h100.inter_node_bandwidth, h100.inter_node_latency)
    assert six.link(3) == (h100.intra_node_bandwidth, h100.intra_node_latency)
    # A cluster inside one node has no boundary to cross.
    assert Cluster(h100, 6, 8).within_node(6)
    a = make_request("llama3-8b", 12, gpus_per_node=6).assumptions
    assert _link(six, a, 4)[1] == a.inter_node_efficiency
    assert _link(six, a, 6)[1] == a.intra_node_efficiency


def test_tp_straddling_nodes_is_refused_with_the_rule():
    layout = Layout(dp=3, tp=4, zero_stage=1, recompute="full", sequence_parallel=True)
    ev = evaluate_layout("llama3-8b", 12, layout, gpus_per_node=6, global_batch=48)
    assert (CONSTRAINT, "tp=4 does not divide the 6 GPUs of a node, so some tp groups "
                        "would straddle two nodes (ranks 4-7); tensor parallelism is placed "
                        "within a node: use tp among 1, 2, 3, 6") in ev.reasons
    # The search follows the same rule: no ranked layout has tp 4.
    result = search(make_request("llama3-8b", 12, gpus_per_node=6, global_batch=48),
                    SearchSpace())
    assert result.ranked and {e.layout.tp for e in result.ranked} <= {1, 2, 3, 6}

