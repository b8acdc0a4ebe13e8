"""Pipeline steps on two ranks: a stalled peer fails with a clear timeout; the schedule is
built once; a step frees each microbatch's saved activations after its backward and its
sent activations during the step (1F1B, zero bubble); transfer and reduction order;
large transfers both ways; zero bubble's head gradient."""

from __future__ import annotations

import time

import pytest
import torch

from partita.layout import Layout
from partita.pipeline.actions import Action, Kind
from partita.saved_tensors import SavedTensorMeter
from partita.testing import FLOAT64_TOL, assert_parity, run_distributed, token_batch, train_layout
from tests.dist.pipeline_cases import pipeline_config


def _batch(cfg) -> torch.Tensor:
    """Step 0's global batch of the run `cfg` describes."""
    return token_batch(0, cfg.train.global_batch, cfg.data.seq_len,
                       cfg.model_config().vocab_size)


def _stall(rank: int, world: int, cfg) -> str:
    if rank == 1:  # builds the model (collective), then stops taking part
        from partita.mesh import Mesh
        from partita.parallelize import build_parallel_model

        build_parallel_model(cfg, Mesh(Layout(pp=2), rank, world), torch.device("cpu"))
        time.sleep(8)
        return "stalled"
    train_layout(rank, world, cfg, steps=1)
    return "finished"


def test_a_stalled_stage_fails_its_peer_with_a_clear_timeout():
    cfg = pipeline_config(pp_timeout_s=2.0)
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
        run_distributed(_stall, 2, (cfg,), timeout=60)
    text = str(info.value)
    assert "rank 0 of 2 failed" in text
    assert "PipelineTimeout" in text and "stage 0" in text
    assert "RB1.0 (input gradient of stage 1, microbatch 0) from rank 1" in text
    assert time.perf_counter() - start < 30


def _count_schedule_builds(rank: int, world: int, cfg) -> dict:
    """Build the model and train one step (and evaluate) counting, in this process, how
    often a schedule is generated and proven."""
    from unittest import mock

    import partita.pipeline.p2p as p2p

    counts = {"build": 0, "validate": 0, "proof": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    with mock.patch.object(p2p, "build_schedule", counted("build", p2p.build_schedule)), \
            mock.patch.object(p2p, "validate", counted("validate", p2p.validate)), \
            mock.patch.object(p2p, "check_transfer_order",
                              counted("proof", p2p.check_transfer_order)):
        train_layout(rank, world, cfg, steps=1)
    return counts


def test_the_schedule_is_built_and_validated_once_per_process():
    cfg = pipeline_config(schedule="interleaved-1f1b", virtual_stages=2)
    for counts in run_distributed(_count_schedule_builds, 2, (cfg,), timeout=120):
        # Training and evaluating with the configured microbatches reuse the one object
        # that parallelize built (p2p.validated_schedule is the only place that builds).
        assert counts == {"build": 1, "validate": 1, "proof": 1}


class _HeldMeter(SavedTensorMeter):
    """The meter, weak-referencing a detached alias of each saved tensor: alive exactly
    while autograd (or the runtime) holds what was saved. The stock meter references the
    tensor object itself; a node that saves its own output (rsqrt, attention, log-softmax)
    then owns that tensor and the tensor its node, a cycle no collector sees, so a graph
    retained for a deferred W (zero bubble) would never look freed to it."""

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        return super()._pack(t.detach())


def _held_activations(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Per case, one training step under each meter: the peak saved for backward, what
    is still saved after `train` returns, and the runner's own count of held passes."""
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model

    torch.set_num_threads(1)
    out = []
    for case in cases:
        cfg = pipeline_config(schedule=case["schedule"], microbatches=case["m"],
                              global_batch=2 * case["m"])
        pm = build_parallel_model(cfg, Mesh(Layout(pp=2), rank, world),
                                  torch.device("cpu"))
        tokens = _batch(cfg)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        row = {"batch_bytes": x.untyped_storage().nbytes(), "stage": rank}
        for name, kind in (("stock", SavedTensorMeter), ("held", _HeldMeter)):
            meter = kind(pm.module)
            with meter:
                pm.runner.train(x, y, cfg.train.microbatches)
            pm.dp.finish_grad_sync()
            pm.dp.zero_grad()
            row[name] = (meter.peak_bytes, meter.live_bytes)
        row["held_peak"] = max(pm.runner.held_peak.values())
        out.append(row)
    return out


def test_pipeline_steps_free_each_microbatch_after_its_backward():
    """After B (1F1B) or W (zero bubble) of (s, m) nothing of it stays saved: a rank's
    peak does not grow with the microbatch count (ZB-H1, like 1F1B, holds at most p
    microbatches per rank) and nothing is left once `train` returns. The token ids are
    views of the batch (the meter counts their storage, the whole batch, once), so the
    peak may grow by the batch's own growth and nothing more."""
    p, ms = 2, (4, 8)
    cases = [dict(schedule=s, m=m) for s in ("1f1b", "zb-h1") for m in ms]
    per_rank = run_distributed(_held_activations, p, (cases,), timeout=120)
    got = {(c["schedule"], c["m"], r): per_rank[r][i]
           for i, c in enumerate(cases) for r in range(p)}
    for (sched, m, rank), row in got.items():
        assert row["held"][1] == 0, (sched, m, rank, row)  # nothing saved after train
        assert row["held_peak"] <= (p - rank if sched == "1f1b" else p), (sched, rank, row)
        if sched == "1f1b":  # no retained graph here: the stock meter must agree
            assert row["stock"][1] == 0, (sched, m, rank, row)
    for rank in range(p):
        for sched in ("1f1b", "zb-h1"):
            few, many = got[(sched, ms[0], rank)], got[(sched, ms[1], rank)]
            grown = many["batch_bytes"] - few["batch_bytes"]
            meters = ("stock", "held") if sched == "1f1b" else ("held",)
            for meter in meters:
                assert many[meter][0] <= few[meter][0] + grown, (sched, meter, rank, few, many)
        # ZB-H1 holds what 1F1B holds on stage 0 (p microbatches). The last stage holds
        # 1F1B's one microbatch plus what one deferred W reads (its linears' inputs):
        # under 1.5x, where keeping the whole graph until W held nearly 2x.
        zb, ob = got[("zb-h1", ms[1], rank)]["held"][0], got[("1f1b", ms[1], rank)]["held"][0]
        assert zb <= (ob if rank == 0 else 1.5 * ob), (rank, zb, ob)


def _sends_held(rank: int, world: int, ms: tuple[int, ...], shared: bool) -> list[int]:
    """Per microbatch count, the most sent tensors the rank still held after a compute
    (1F1B, pp=2), over two steps; `shared`: through shared-memory rings, else gloo."""
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model

    torch.set_num_threads(1)
    out = []
    for m in ms:
        cfg = pipeline_config(microbatches=m, global_batch=2 * m)
        pm = build_parallel_model(cfg, Mesh(Layout(pp=2), rank, world, shm_collectives=shared),
                                  torch.device("cpu"))
        transport, held = pm.runner.transport, [0]
        assert (transport.channels is not None) == shared

        def counted(transport=transport, release=transport.release_sent, held=held) -> None:
            release()
            proven = sum(len(sends) for sends in transport.proven.values())
            held[0] = max(held[0], len(transport.pending_sends) + proven)
        transport.release_sent = counted
        tokens = _batch(cfg)
        for _ in range(2):
            pm.runner.train(tokens[:, :-1], tokens[:, 1:], m)
            pm.dp.finish_grad_sync()
            pm.dp.zero_grad()
        out.append(held[0])
    return out


@pytest.mark.parametrize("shared", [False, True], ids=["gloo", "rings"])
def test_sent_activations_are_freed_during_the_step_not_at_its_end(shared: bool):
    """gloo marks a send complete only when waited on; without the transport's reaper
    and the receives that prove a send delivered, the first stage kept all m sent
    activations until the step's end. With them, what a rank holds does not grow with m
    (timing decides the exact figure: a few). A send into a shared-memory ring is done
    once its bytes are in."""
    ms = (8, 32)
    per_rank = run_distributed(_sends_held, 2, (ms, shared), timeout=120)
    for rank, (few, many) in enumerate(per_rank):
        assert many <= few + 4 and many < ms[0], (rank, few, many)


def _recorded_order(rank: int, world: int, schedule: str) -> list[str]:
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model

    cfg = pipeline_config(schedule=schedule)
    pm = build_parallel_model(cfg, Mesh(Layout(pp=2), rank, world), torch.device("cpu"))
    tokens = _batch(cfg)
    pm.runner.train(tokens[:, :-1], tokens[:, 1:], cfg.train.microbatches)
    return [str(a) for a, _, _ in sorted(pm.runner.timeline, key=lambda e: e[1])]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_last_backward_sends_its_input_gradient_before_its_weight_pass(schedule):
    """The last rank's last backward runs as I, then the send of its input gradient,
    then W (as recorded by the runtime, not only as planned); every other backward of
    the step stays one B, and rank 0 (nothing to send) keeps a whole B."""
    first, last = run_distributed(_recorded_order, 2, (schedule,), timeout=120)
    assert last[-3:] == ["I1.3", "SB1.3", "W1.3"], last
    assert [a for a in last if a[0] in "BIW"] == ["B1.0", "B1.1", "B1.2", "I1.3", "W1.3"]
    assert [a for a in first if a[0] in "BIW"] == ["B0.0", "B0.1", "B0.2", "B0.3"]


def _chunk_reduction_worker(rank: int, world: int, zero: int) -> dict:
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model
    from partita.pipeline.stage import stage_parameters

    cfg = pipeline_config(dp=2, zero_stage=zero, schedule="interleaved-1f1b",
                          virtual_stages=2)
    mesh = Mesh(Layout(dp=2, pp=2, zero_stage=zero), rank, world)
    pm = build_parallel_model(cfg, mesh, torch.device("cpu"))
    dp, runner = pm.dp, pm.runner
    stage_of = {id(p): i for i, s in runner.stages.items()
                for p in stage_parameters(dp.module, runner.plan, s)}
    spans = [len({stage_of[id(p)] for p in buf.params}) for buf in dp.buckets]
    tokens = _batch(cfg).chunk(2)[mesh.coord.dp]
    # When each bucket's collective is launched: how many actions the timeline held.
    at, launch = [], dp.reducer._launch
    dp.reducer._launch = lambda b: (at.append(len(runner.timeline)), launch(b))
    mesh.counter.reset()
    runner.train(tokens[:, :-1], tokens[:, 1:], cfg.train.microbatches)
    launched_in_backward = list(dp.reducer.launched)
    dp.finish_grad_sync()
    calls = mesh.counter.calls[("zero_shard", "reduce_scatter")]
    last_backward = max(i for i, (a, *_) in enumerate(runner.timeline) if a.kind is Kind.B)
    return {"spans": spans, "launched": launched_in_backward, "calls": calls,
            "buckets": len(dp.buckets), "m": cfg.train.microbatches,
            "first_launch": min(at), "last_backward": last_backward}


@pytest.mark.parametrize("zero", [1, 2])
def test_interleaved_stages_reduce_their_own_buckets_during_backward(zero: int) -> None:
    """dp2 x pp2, interleaved v=2: buckets never span two of a rank's stages; ZeRO-1
    launches every bucket during its stage's last backward (none waits for the step's
    end), and ZeRO-2 reduce-scatters each bucket once per microbatch, not once per
    microbatch and stage."""
    for got in run_distributed(_chunk_reduction_worker, 4, args=(zero,), timeout=180):
        assert set(got["spans"]) == {1}
        # Reductions start while backward passes are still to come on this rank.
        assert got["first_launch"] < got["last_backward"]
        if zero == 1:
            assert all(got["launched"]) and got["calls"] == got["buckets"]
        else:
            assert got["calls"] == got["m"] * got["buckets"]


def _exchange_large(rank: int, world: int, numel: int, rings: bool) -> tuple[bool, bool]:
    """Both ranks post [send, receive] of `numel` floats to each other at once, sends
    from the calling thread (gloo), with no receive posted ahead; or, with `rings`,
    through shared-memory rings (each far smaller than a transfer). Returns (rings used,
    the right bytes arrived)."""
    from partita.mesh import Mesh
    from partita.pipeline.actions import Kind
    from partita.pipeline.p2p import Transport, neighbour_pairs

    comm = Mesh(Layout(pp=2), rank, world).comm("pipeline")
    pairs = neighbour_pairs(2, lambda s: s) if rings else None
    transport = Transport(comm, lambda stage: comm.ranks[stage], 60.0, rank, pairs)
    mine = torch.full((numel,), float(rank + 1))
    got = torch.empty(numel)
    if rank == 0:
        batch = [(Action(Kind.SEND_F, 0, 0), mine), (Action(Kind.RECV_B, 1, 0), got)]
    else:
        batch = [(Action(Kind.SEND_B, 1, 0), mine), (Action(Kind.RECV_F, 0, 0), got)]
    for action, work in transport.post(batch):
        transport.wait(action, work)
    transport.finish()
    return transport.channels is not None, bool((got == float(2 - rank)).all())


@pytest.mark.parametrize("rings", [False, True], ids=["gloo", "rings"])
def test_large_transfers_both_ways_at_once_do_not_deadlock(rings: bool):
    """Sends are posted from the runner's thread on gloo: 64 MB each way at once (far
    beyond a socket's buffer) must still complete, within the transport's timeout; the
    same through rings of 2 MiB, each send streamed by its pair's helper thread."""
    got = run_distributed(_exchange_large, 2, (16 * 2**20, rings), timeout=120)
    assert got == [(rings, True)] * 2


def _zero_bubble_head(rank: int, world: int, vocab: int, tied: bool) -> dict:
    """One ZB-H1 step of the same model twice: the output projection's weight gradient
    formed right after I (the runtime's way) and deferred to W like every other weight.
    Per way: the most the stage held for backward (saved tensors + the runner's own
    count of gradients kept outside autograd) and every gradient afterwards."""
    from partita.mesh import Mesh
    from partita.parallelize import build_parallel_model

    torch.set_num_threads(1)
    cfg = pipeline_config(schedule="zb-h1", global_batch=32,
                          model={"vocab_size": vocab, "tie_embeddings": tied})
    tokens = _batch(cfg)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    out = {}
    for way in ("early", "deferred"):
        pm = build_parallel_model(cfg, Mesh(Layout(pp=2), rank, world),
                                  torch.device("cpu"))
        if way == "deferred":
            pm.runner.early_params = []
        out[way] = _measured_step(pm, x, y, cfg.train.microbatches)
    return out


def _measured_step(pm, x: torch.Tensor, y: torch.Tensor, m: int) -> dict:
    runner = pm.runner
    with SavedTensorMeter(pm.module, lambda: runner.deferred_bytes) as meter:
        runner.train(x, y, m)
    pm.dp.finish_grad_sync()
    return {"peak": meter.peak_bytes, "left": runner.deferred_bytes,
            "grads": {n: p.grad.clone() for n, p in pm.module.named_parameters()}}


@pytest.mark.parametrize("tied", [False, True])
def test_zero_bubble_forms_the_head_gradient_after_i_not_in_w(tied):
    """ZB-H1's last stage forms the output projection's weight gradient right after each
    I, so no deferred W keeps the logits' gradient (tokens x vocabulary): the gradients
    are those of deferring it (the same sums in the same order), the stage holds
    less by about the logits' gradients that were waiting, and nothing stays counted."""
    vocab, tokens_per_mb = 2048, 8 * 16  # batch 32 in 4 microbatches of 16 tokens
    got = run_distributed(_zero_bubble_head, 2, (vocab, tied), timeout=180)
    for rank, row in enumerate(got):
        early, deferred = row["early"], row["deferred"]
        assert early["grads"].keys() == deferred["grads"].keys()
        # Equal up to float64 rounding: bitwise on some CPUs, not on others (AMD EPYC,
        # AVX2, where the embedding and head gradients differ in their last bits).
        assert_parity(early["grads"], deferred["grads"], FLOAT64_TOL, f"rank {rank}")
        assert early["left"] == deferred["left"] == 0
    logits_grad = tokens_per_mb * vocab * 8  # float64: 2 MiB
    head_sum = vocab * 32 * 8  # the step's sum of head gradients (dim 32): 0.5 MiB
    first, last = got[0], got[1]
    assert first["early"]["peak"] == first["deferred"]["peak"]  # stage 0: no head
    # At most one microbatch waits for W on the last stage of two (ZB-H1 at p = 2).
    saved = last["deferred"]["peak"] - last["early"]["peak"]
    assert saved >= logits_grad - head_sum, (saved, logits_grad, head_sum)
