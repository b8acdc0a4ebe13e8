"""Planner search, rejection reasons and advice."""

import pytest

from partita.errors import PartitaError
from partita.planner import (
    advise_layout,
    advise_search,
    evaluate,
    evaluate_layout,
    make_request,
    parse_layout,
    plan,
)
from partita.planner.evaluate import CONSTRAINT, DIVISIBILITY, MEMORY, UNAVAILABLE
from partita.planner.search import DEFAULT_SPACE, SearchSpace, search


def test_405b_on_16384_gpus():
    # Every option the planner models, the ones partita does not train yet included:
    # the prunings keep a six-figure search fast, and nothing unavailable is ranked.
    result = plan("llama3-405b", 16384, space=SearchSpace.everything(), gpu_type="H100",
                  global_batch=2048)
    assert result.searched > 100_000
    assert result.ranked
    best = result.best.layout
    assert best.world_size == 16384 and best.tp <= 8
    for ev in result.ranked:
        assert ev.memory["total"] <= 80e9
        assert not (ev.layout.zero_stage == 3 and ev.layout.pp > 1)
        assert ev.layout.tp <= 8
        assert ev.layout.ep == 1
    # Context parallelism is modelled and checked against measurements: ranked. At 2048
    # sequences it frees data-parallel ranks for more microbatches per pipeline.
    assert any(ev.layout.cp > 1 for ev in result.ranked)
    steps = [e.time["step_s"] for e in result.ranked]
    assert all(a <= b * (1 + 1e-5) for a, b in zip(steps, steps[1:]))
    # Nothing a dense model can use is unavailable (cp runs with recomputation).
    assert set(result.rejected) == {MEMORY, DIVISIBILITY, CONSTRAINT}
    # Every enumerated layout is counted once: fitting or rejected.
    assert result.searched == len(result.ranked) + sum(result.rejected.values())


def test_small_model_prefers_plain_data_parallel():
    result = plan("tiny", 8, gpu_type="H100", seq_len=128, global_batch=64)
    assert result.best.layout.tp == 1
    # A pipeline of two may be predicted a few percent faster (a model this small is
    # all latency); plain data parallelism is within that of the best.
    plain = next(e for e in result.ranked if e.layout.dp == 8)
    assert plain.time["step_s"] <= 1.1 * result.best.time["step_s"]


def _reasons(layout_text, model="llama3-70b", gpus=64, **kw):
    req = make_request(model, gpus, **kw)
    ev = evaluate(req, parse_layout(layout_text, gpus))
    return ev, [k for k, _ in ev.reasons], " ".join(r for _, r in ev.reasons)


def test_rejection_reasons():
    _, kinds, text = _reasons("tp=16 pp=4", global_batch=512)
    assert CONSTRAINT in kinds and "within a node" in text
    _, kinds, text = _reasons("tp=3 dp=1 pp=1", gpus=3)
    assert set(kinds) == {DIVISIBILITY} and "n_heads=64" in text
    _, kinds, text = _reasons("tp=8 pp=2 zero_stage=3")
    assert CONSTRAINT in kinds and "ZeRO stage 3 with pipeline" in text
    _, kinds, text = _reasons("dp=64 zero_stage=0")
    assert kinds == [MEMORY] and "GB per GPU" in text
    _, kinds, text = _reasons("tp=8 pp=4 dp=2", global_batch=3)
    assert DIVISIBILITY in kinds
    _, kinds, text = _reasons("tp=8 pp=4 virtual_stages=30", global_batch=512)
    assert DIVISIBILITY in kinds or CONSTRAINT in kinds
    _, kinds, text = _reasons("tp=8 dp=4 ep=2 pp=2")
    assert "no MoE blocks" in text and text.count("MoE") == 2  # the rule, said once


def test_layout_advice_fixes_the_layout():
    req = make_request("llama3-8b", 8, seq_len=8192, global_batch=64)
    ev = evaluate(req, parse_layout("dp=8 zero_stage=0 microbatch_size=4", 8))
    assert not ev.fits
    advice = advise_layout(req, ev)
    assert advice
    # Each suggestion names a layout that does fit.
    for line in advice:
        layout_text = line.split(": ", 1)[1].rsplit(" fits", 1)[0]
        if "--" in line:
            continue
        assert evaluate(req, parse_layout(layout_text, 8)).fits


def test_search_advice_when_nothing_fits():
    req = make_request("llama3-405b", 8, gpu_type="A100-40GB", seq_len=2048, global_batch=64)
    assert not search(req).ranked
    advice = advise_search(req)
    assert any("--gpus" in a for a in advice)
    # The suggested GPU count really fits.
    gpus = int(next(a for a in advice if "--gpus" in a).split("--gpus ")[1].split(":")[0])
    assert search(make_request("llama3-405b", gpus, gpu_type="A100-40GB", seq_len=2048,
                               global_batch=64)).ranked


def test_offload_is_advised_host_memory_before_disk():
    """A model bigger than one GPU: offload (which partita trains) is the change that
    costs no hardware, host memory first; the suggested layout fits with it. The host
    memory counted is that of the one GPU in use, not of a full node."""
    req = make_request("llama3-8b", 1, gpu_type="A100-40GB", seq_len=4096, global_batch=8)
    assert not search(req).ranked
    first = advise_search(req)[0]
    assert first.startswith("offload to host memory, --fix offload=optimizer+params: ")
    layout = parse_layout(first.split(": ", 1)[1].split(" fits")[0], 1)
    ev = evaluate(req, layout)
    assert ev.fits and layout.zero_stage == 3
    assert ev.host_bytes_per_node < 0.2 * req.cluster.gpu.host_memory_per_node
    assert f"{ev.host_bytes_per_node / 1e9:.0f} GB of host memory per node" in first
    # Eight times the host memory of one GPU's states does not fit a node: disk then.
    big = make_request("llama3-70b", 8, gpu_type="A100-40GB")
    first = advise_search(big)[0]
    assert first.startswith("offload to disk, --fix offload=optimizer+params+disk: ")
    assert " GB of disk per node)" in first
    # Its `partita train` command names the folder disk offload needs.
    from partita.planner.report import train_command

    disk = evaluate(big, parse_layout(first.split(": ", 1)[1].split(" fits")[0], 8))
    command = train_command(big, disk)
    assert "--parallel.offload=optimizer+params+disk " in command
    assert "--parallel.offload_dir=DIR " in command
    assert command.endswith(f"(DIR: a folder on a local disk with "
                            f"{disk.disk_bytes_per_node / 1e9:.0f} GB free on each node)")
    # One layout: offload comes after the knobs that cost less speed.
    ev = evaluate(req, parse_layout("dp=1", 1))
    advice = advise_layout(req, ev)
    assert "offload=optimizer+params" in advice[0] and "zero_stage=3" in advice[0]
    fitting = make_request("llama3-8b", 8, gpu_type="A100-40GB", seq_len=4096,
                           global_batch=8)
    ev = evaluate(fitting, parse_layout("dp=8 zero_stage=0 microbatch_size=1", 8))
    assert not ev.fits and "offload" not in advise_layout(fitting, ev)[0]


def test_the_closest_miss_names_the_memory_it_overflows():
    from partita.planner.report import format_search

    req = make_request("llama3-70b", 8, gpu_type="A100-40GB")
    result = search(req, SearchSpace(offload=("optimizer+params",),
                                     fixed=(("offload", "optimizer+params"),)))
    assert not result.ranked
    closest = next(line for line in format_search(result, 3).splitlines()
                   if line.startswith("The closest"))
    assert "GB of host memory per node, a node has 1000 GB" in closest, closest


def test_restricted_space_advice_relaxes_it():
    req = make_request("llama3-8b", 8, seq_len=8192, global_batch=64)
    narrow = SearchSpace(zero_stages=())
    assert not search(req, narrow).ranked
    advice = advise_search(req, narrow)
    assert advice[0].startswith("allow every")


def test_pinned_search_advice_names_the_pins():
    """`partita plan --fix ...` with nothing fitting: the advice drops the pins by name
    and keeps them in the offload it suggests."""
    from partita.commands.plan import _parse_fix, _pinned_space

    req = make_request("llama3-8b", 8, seq_len=8192, global_batch=64)
    pinned = _pinned_space(DEFAULT_SPACE, _parse_fix("tp=1,pp=1,zero_stage=0"))
    assert not search(req, pinned).ranked
    advice = advise_search(req, pinned)
    assert advice[0].startswith("drop --fix tp=1,pp=1,zero_stage=0: "), advice
    offload = next(a for a in advice if a.startswith("offload"))
    assert "--fix tp=1,pp=1,zero_stage=0,offload=" in offload
    layout = parse_layout(offload.split(": ", 1)[1].split(" fits")[0], 8)
    assert (layout.tp, layout.pp, layout.zero_stage) == (1, 1, 0)
    assert evaluate(req, layout).fits


def test_shorter_sequence_advice():
    # 128k tokens fit once the blocks are recomputed; 512k need a shorter sequence too.
    req = make_request("llama3-8b", 8, seq_len=131072, global_batch=8)
    ev = evaluate(req, parse_layout("tp=8 zero_stage=1", 8))
    assert not ev.fits
    assert advise_layout(req, ev)[0].startswith("recompute=full:")
    req = make_request("llama3-8b", 8, seq_len=524288, global_batch=8)
    ev = evaluate(req, parse_layout("tp=8 zero_stage=1", 8))
    assert any("--seq-len 262144" in a for a in advise_layout(req, ev))


def test_moe_advice_splits_the_experts_over_tp():
    # Mixtral on 32 H100s at tp=2 x ep=4 with every expert on both tp ranks needs 136 GB;
    # splitting them over tp (and sharding optimizer state) fits.
    req = make_request("mixtral-8x7b", 32, seq_len=4096)
    ev = evaluate(req, parse_layout("tp=2 ep=4", 32))
    assert not ev.fits
    advice = advise_layout(req, ev)
    changes = [a.split(":")[0] for a in advice]
    assert changes and all("moe_tp=experts" in c or "moe_tp=hidden" in c for c in changes), advice
    assert changes[0] == "zero_stage=1 moe_tp=experts", advice  # the fastest of the fewest
    assert evaluate(req, parse_layout(advice[0].split(": ", 1)[1].split(" fits")[0], 32)).fits
    # Searched both ways; pinned, one way only.
    found = search(req, SearchSpace(fixed=(("tp", 2),))).ranked
    assert {e.layout.moe_tp for e in found} == {"replicate", "experts", "hidden"}
    pinned = search(req, SearchSpace(fixed=(("tp", 2), ("moe_tp", "replicate")))).ranked
    assert pinned and {e.layout.moe_tp for e in pinned} == {"replicate"}


def test_unavailable_options_are_not_advised():
    req = make_request("llama3-8b", 2, gpu_type="A100-40GB", seq_len=131072, global_batch=8)
    ev = evaluate(req, parse_layout("tp=2 tp_comm_overlap=true recompute=full "
                                    "offload=optimizer", 2))
    assert {k for k, _ in ev.reasons} >= {UNAVAILABLE, MEMORY}
    assert advise_layout(req, ev) == []


def test_evaluate_layout_api_and_moe(tmp_path):
    ev = evaluate_layout("llama3-8b", 16, "tp=8 zero_stage=1", seq_len=4096, global_batch=32)
    assert ev.fits and ev.layout.dp == 2
    cfg = tmp_path / "moe.toml"
    cfg.write_text("[model]\nvocab_size = 32000\ndim = 2048\nn_layers = 16\nn_heads = 16\n"
                   "max_seq_len = 4096\n[moe]\nnum_experts = 8\ntop_k = 2\n")
    moe = evaluate_layout(str(cfg), 16, "dp=16 ep=8 zero_stage=1", seq_len=4096,
                          global_batch=64)
    dense_ep = evaluate_layout(str(cfg), 16, "dp=16 ep=1 zero_stage=1", seq_len=4096,
                               global_batch=64)
    # Expert parallelism trains: modelled (memory, traffic) and ranked like the rest.
    assert moe.reasons == [] and moe.fits and moe.time["ep_bytes"] > 0
    assert moe.memory["parameters"] < dense_ep.memory["parameters"]
    assert dense_ep.fits
    result = plan(str(cfg), 16, seq_len=4096, global_batch=64)
    assert result.ranked
    # Context parallelism with MoE blocks trains: searched when asked for, and ranked
    # (4 GPUs keep the search short).
    with_cp = plan(str(cfg), 4, space=SearchSpace(fixed=(("cp", 2),)), seq_len=4096,
                   global_batch=64)
    assert with_cp.ranked and all(e.layout.cp == 2 for e in with_cp.ranked)
    assert any(e.layout.ep > 1 for e in with_cp.ranked)


def test_bad_layout_text():
    with pytest.raises(PartitaError, match="name=value"):
        parse_layout("dp:2")
    with pytest.raises(PartitaError, match="recompute"):
        parse_layout("recompute=some")


def test_pinned_context_parallel_kind_is_searched_and_ranked():
    space = SearchSpace(fixed=(("cp", 2), ("cp_kind", "allgather")))
    result = plan("llama3-8b", 16, space=space, gpu_type="H100", seq_len=32768,
                  global_batch=64)
    assert result.ranked
    assert all(e.layout.cp == 2 and e.layout.cp_kind == "allgather" for e in result.ranked)
    ring = plan("llama3-8b", 16, space=SearchSpace(fixed=(("cp", 2),)), gpu_type="H100",
                seq_len=32768, global_batch=64)
    # At c = 2 the two kinds send the same forward bytes; the ring hides its hops.
    assert ring.best.time["step_s"] <= result.best.time["step_s"]


def test_host_and_disk_bytes_follow_the_requests_assumptions():
    """Offloaded states are counted with the request's assumptions (its disk buffer
    budget, partita's buffer padding), not the defaults."""
    import dataclasses

    from partita.planner.assumptions import Assumptions

    layout = parse_layout("dp=8 zero_stage=3 offload=optimizer+disk", 8)
    base = Assumptions.for_device("H100")
    small = dataclasses.replace(base, disk_host_budget_bytes=2.0e8)
    evs = [evaluate(make_request("llama3-8b", 8, assumptions=a), layout) for a in (base, small)]
    # The budget binds (a llama3-8b bucket's owned slice is larger than a sub-group):
    # the engine's buffer sets fill it but for the cast scratch it sizes the sub-group
    # for (4 bytes of 46 per element) and allocates at most 2^18 elements of.
    for ev, a in zip(evs, (base, small)):
        assert 0.9 * 8 * a.disk_host_budget_bytes < ev.host_bytes_per_node \
            <= 8 * a.disk_host_budget_bytes
    assert evs[0].disk_bytes_per_node == evs[1].disk_bytes_per_node > 0


def test_a_plan_over_several_nodes_prints_the_command_each_node_runs(monkeypatch):
    """`--nproc 16` on one 8-GPU machine would oversubscribe it: a plan over two nodes
    prints the per-node command (`--nnodes`, the node's own `--nproc`, a rendezvous),
    and `partita train` parses it so."""
    import shlex

    import partita.commands.train as train_cli
    from partita.cli import main
    from partita.planner.report import train_command

    req = make_request("llama3-8b", 16)
    ev = search(req).ranked[0]
    command = train_command(req, ev)
    assert command.startswith("partita train --nnodes 2 --nproc 8 --rdzv-endpoint HEAD:29500 "
                              "--rdzv-id JOB --parallel.dp=")
    assert command.endswith(" on each of the 2 nodes (HEAD: the first node's address, "
                            "JOB: a name for the job)")
    seen = {}
    monkeypatch.setattr(train_cli, "run", lambda args: seen.update(vars(args)) or 0)
    argv = shlex.split(command.split(" on each")[0])[1:]
    assert main(argv) == 0
    assert (seen["nnodes"], seen["nproc"], seen["rdzv_id"]) == (2, 8, "JOB")
    one_node = make_request("llama3-8b", 8)
    assert train_command(one_node, search(one_node).ranked[0]).startswith(
        "partita train --nproc 8 --parallel.dp=")
