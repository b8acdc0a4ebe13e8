"""Expert parallelism against one process holding every expert, in float64.

Each case trains 6 steps; losses, gradient norms, the auxiliary losses (balance and
z-loss, as the log reports them), tokens per expert and every final parameter (each
rank's experts against the same rows of the reference's stacked experts) must match
within 1e-10. One spawned world of 4 ranks runs ep=2 and ep=4, top-1 and top-2,
dropless and capacity, ZeRO-1 and ZeRO-3, a checkpoint saved under ep=2 resumed under
ep=4; a rank whose experts get no token (a
router forced to send everything to expert 0) must still finish; a router forced to
balance gives the documented all-to-all bytes. In the same world, activation
recomputation: full (every rank reruns its MoE blocks, all-to-alls included, in
backward; under a pipeline the last backward is split in two, so each rerun happens
twice and the statistics must still count once) and selective; tp=2 with sequence
parallelism (ZeRO-1, and ZeRO-3 with full recompute and capacity); cp=2 with ep=2 and
with tp=2 + sp (capacity in both, so queues span the chunks of other ranks); the experts
split over the tp ranks (moe_tp="experts": with ep=2, with sp + ZeRO-3 + full recompute,
and over tp=4), each expert's width split over tp (moe_tp="hidden": with ep=2, and with
sp + ZeRO-3 + full recompute), and checkpoints resharded from widths split over tp to
experts split over tp x ep to every expert on every rank.
One world of 8 runs
dp=2 x tp=2 x pp=2 with ep=2: the tensor- and pipeline-parallel case.
"""

from __future__ import annotations

import pytest
import torch

from partita.checkpoint.manifest import read_manifest, resolve
from partita.experts import moe_step_stats
from partita.models.moe import moe_modules
from partita.models.transformer import Transformer
from partita.planner.model_shape import PlanModel
from partita.planner.stage_params import stage_param_counts
from partita.testing import (
    FLOAT64_TOL,
    Case,
    assert_parity,
    compare_to_reference,
    parity_config,
    reference,
    run_layouts,
)
from tests.dist.step_probes import record_steps

STEPS = 6
MOE = dict(n_experts=8, top_k=2, expert_ffn_dim=16, aux_loss_weight=0.1, z_loss_weight=0.01)


def moe_cfg(parallel: dict, train: dict | None = None, **model):
    return parity_config(model={**MOE, **model}, parallel=parallel,
                         train={"lr": 1e-2, **(train or {})})


def record_moe(pm, cfg) -> list:
    """The step's MoE figures and all-to-all bytes after each step."""
    def figures(_) -> dict:
        stats = moe_step_stats(pm.module, pm.mesh)
        return {"aux": stats["aux_loss"], "z": stats["z_loss"],
                "tokens": stats["tokens_per_expert"],
                "a2a_bytes": pm.mesh.counter.total("expert", "all_to_all"),
                "moe_layers": len(moe_modules(pm.module))}

    return record_steps(pm, figures)


def _routed_model(route, top_k: int):
    cfg = moe_cfg(dict(dp=4, ep=4), top_k=top_k).model_config()
    with torch.device("meta"):
        model = Transformer(cfg)
    for _, moe in moe_modules(model):
        moe.forced_route = route
    return model, model.plan()


def all_to_expert_zero():
    """Every choice to expert 0 (top-1): the other ep ranks' experts get no token."""
    return _routed_model(lambda n, k, e: torch.zeros(n, k, dtype=torch.long), 1)


def balanced():
    """Choice j of token i to expert (i*k + j) mod E: every expert, every rank alike."""
    return _routed_model(lambda n, k, e: torch.arange(n * k).view(n, k) % e, 2)


CASES = [
    Case("ep2-top2-dropless", moe_cfg(dict(dp=4, ep=2)), params=True),
    Case("ep4-top1-capacity", moe_cfg(dict(dp=4, ep=4, zero_stage=1), top_k=1,
                                      capacity_factor=1.0), params=True),
    Case("ep4-top2-capacity-sigmoid", moe_cfg(dict(dp=4, ep=4), capacity_factor=1.25,
                                              router_gating="sigmoid", shared_experts=1),
         params=True),
    Case("ep2-top1-zero3", moe_cfg(dict(dp=4, ep=2, zero_stage=3, bucket_mb=0.01),
                                   train=dict(microbatches=2), top_k=1), params=True),
    # The recompute takes the experts' unit (inside the block's) as inputs at its start.
    Case("ep2-zero3-recompute-full", moe_cfg(dict(dp=4, ep=2, zero_stage=3, bucket_mb=0.01,
                                                  recompute="full")), params=True),
    Case("ep2-pp2-recompute-full", moe_cfg(dict(dp=2, pp=2, ep=2, recompute="full"),
                                           train=dict(microbatches=2)), params=True),
    Case("ep4-top1-capacity-recompute-selective",
         moe_cfg(dict(dp=4, ep=4, zero_stage=1, recompute="selective"), top_k=1,
                 capacity_factor=1.0), params=True),
    # Sequence parallelism: each MoE feed-forward gathers the sequence, routes it whole
    # (capacity and balance loss per sequence) and keeps its own shard of the output.
    Case("tp2-sp-ep2-zero1", moe_cfg(dict(dp=2, tp=2, ep=2, zero_stage=1,
                                          sequence_parallel=True)), params=True),
    Case("tp2-sp-ep2-zero3-recompute-full-capacity",
         moe_cfg(dict(dp=2, tp=2, ep=2, zero_stage=3, bucket_mb=0.01, recompute="full",
                      sequence_parallel=True), train=dict(microbatches=2), top_k=1,
                 capacity_factor=1.0), params=True),
    # Context parallelism: each rank routes its own chunks; the balance loss sums and
    # the capacity queues span the whole sequence over the context group.
    Case("cp2-ep2-capacity", moe_cfg(dict(dp=2, cp=2, ep=2, zero_stage=1),
                                     capacity_factor=1.0), params=True),
    Case("cp2-tp2-sp-zero3-recompute-full-capacity-sigmoid",
         moe_cfg(dict(cp=2, tp=2, sequence_parallel=True, zero_stage=3, bucket_mb=0.01,
                      recompute="full"), capacity_factor=1.25, router_gating="sigmoid",
                 shared_experts=1), params=True),
    # The tp ranks split the experts (moe_tp="experts"): each runs its own experts'
    # choices and a slice of the shared expert; the partial outputs are summed over tp.
    Case("tp2-experts-ep2-shared-capacity",
         moe_cfg(dict(dp=2, tp=2, ep=2, zero_stage=1, moe_tp="experts"),
                 capacity_factor=1.25, shared_experts=1), params=True),
    Case("tp2-sp-experts-zero3-recompute-full-shared",
         moe_cfg(dict(dp=2, tp=2, zero_stage=3, bucket_mb=0.01, recompute="full",
                      sequence_parallel=True, moe_tp="experts"),
                 train=dict(microbatches=2), shared_experts=1), params=True),
    Case("tp4-sp-experts-top1-capacity",
         moe_cfg(dict(tp=4, sequence_parallel=True, moe_tp="experts"), top_k=1,
                 capacity_factor=1.0), params=True),
    # The tp ranks split each expert's width (moe_tp="hidden"): every rank runs every
    # choice through its slice; experts over ep and widths over tp (two cuts).
    Case("tp2-hidden-ep2-shared-capacity",
         moe_cfg(dict(dp=2, tp=2, ep=2, zero_stage=1, moe_tp="hidden"),
                 capacity_factor=1.25, shared_experts=1), params=True),
    Case("tp2-sp-hidden-zero3-recompute-full",
         moe_cfg(dict(dp=2, tp=2, ep=2, zero_stage=3, bucket_mb=0.01, recompute="full",
                      sequence_parallel=True, moe_tp="hidden"),
                 train=dict(microbatches=2)), params=True),
]
ONE_SIDED = Case("ep4-one-sided", moe_cfg(dict(dp=4, ep=4), top_k=1), params=True,
                 model=all_to_expert_zero)
BALANCED = Case("ep4-balanced", moe_cfg(dict(dp=4, ep=4)), model=balanced, steps=1)
# Full recompute reruns each forward's dispatch and return in backward: 3 passes, not 2.
BALANCED_FULL = Case("ep4-balanced-recompute-full", moe_cfg(dict(dp=4, ep=4, recompute="full")),
                     model=balanced, steps=1)


def _reference(case: Case) -> dict:
    # Layouts of one model share one reference (one process, one microbatch).
    return reference(case.cfg, case.steps or STEPS, params=case.params, model=case.model,
                     probe=record_moe)


def _check(cases: list[Case], runs: list[list[dict]]) -> list[str]:
    failures = []
    for case, ranks in zip(cases, runs):
        ref = _reference(case)
        if not ref["losses"][-1] < ref["losses"][0]:
            failures.append(f"{case.id}: the reference did not train: {ref['losses']}")
        for rank, got in enumerate(ranks):
            actual, expected = compare_to_reference(got, ref)
            for key in ("aux", "z", "tokens"):
                actual[f"moe {key}"] = [step[key] for step in got["probe"]]
                expected[f"moe {key}"] = [step[key] for step in ref["probe"]]
            try:
                assert_parity(actual, expected, FLOAT64_TOL, f"{case.id} rank {rank}")
            except AssertionError as exc:
                failures.append(str(exc))
        held = {key for got in ranks for key in got.get("params", {})}
        lost = sorted(set(ref.get("params", {})) - held)
        if lost:
            failures.append(f"{case.id}: no rank holds {lost[:5]}")
    return failures


def test_expert_parallel_matches_one_process(tmp_path) -> None:
    # A checkpoint saved at step 3 under ep=2 (ZeRO-1) resumes under ep=4 (ZeRO-2):
    # experts resharded, the last 3 steps as one process trains them.
    save = Case("save-ep2", moe_cfg(dict(dp=4, ep=2, zero_stage=1)), steps=STEPS // 2,
                save_to=str(tmp_path))
    resume = Case("resume-ep4", moe_cfg(dict(dp=4, ep=4, zero_stage=2)), params=True,
                  resume_from=str(tmp_path))
    # Experts split over ep and their widths over tp (pieces cut two ways) resume with
    # the experts split over tp x ep; those resume with each rank holding all of them
    # (dp4, ZeRO-3 sharding them as ordinary parameters).
    save_hidden = Case("save-tp2-hidden-ep2", moe_cfg(dict(dp=2, tp=2, ep=2, zero_stage=1,
                                                            moe_tp="hidden")),
                       steps=2, save_to=str(tmp_path / "hidden"))
    save_tp = Case("resume-save-tp2-experts-ep2",
                   moe_cfg(dict(dp=2, tp=2, ep=2, zero_stage=1, moe_tp="experts")),
                   steps=4, resume_from=str(tmp_path / "hidden"), save_to=str(tmp_path / "tp"))
    resume_dp = Case("resume-dp4-zero3", moe_cfg(dict(dp=4, zero_stage=3)), params=True,
                     resume_from=str(tmp_path / "tp"))
    cases = [*CASES, ONE_SIDED, save, resume, save_hidden, save_tp, resume_dp, BALANCED,
             BALANCED_FULL]
    runs = run_layouts(cases, 4, STEPS, probe=record_moe, timeout=300)
    n = len(CASES) + 1
    failures = _check(cases[:n], runs[:n])  # through the one-sided case
    ref = _reference(CASES[0])  # the same model and batches
    for label, resumed, first in (("resume-ep4", runs[n + 1], STEPS // 2),
                                  ("resume-dp4-zero3", runs[n + 4], 4)):
        for rank, got in enumerate(resumed):
            actual, expected = compare_to_reference(got, ref)
            for key in ("loss", "grad norm"):
                expected[key] = expected[key][first:]
            try:
                assert_parity(actual, expected, FLOAT64_TOL, f"{label} rank {rank}")
            except AssertionError as exc:
                failures.append(str(exc))
    # The pieces cut two ways are written as such, in format version 2 (older partita
    # refuses it instead of misplacing them); the others stay version 1.
    two_cuts = read_manifest(resolve(tmp_path / "hidden"))
    assert two_cuts["version"] == 2
    assert any(p.get("more") == [[1, 0, 8]] for p in two_cuts["pieces"])
    assert read_manifest(resolve(tmp_path / "tp"))["version"] == 1
    # Expert parameters per rank: the engine's ledger, as the planner counts them (E/ep
    # of each MoE block, E/(tp*ep) with moe_tp="experts"; stage 0 keeps them whole, ZeRO-3
    # a 1/(dp/ep) slice at rest). At ep=1 the experts are ordinary parameters of their
    # block, not a family of their own.
    for case, ranks in zip(CASES, runs):
        layout = case.cfg.layout(4)
        if layout.ep == 1:
            continue
        plan_model = PlanModel("moe", case.cfg.model_config())
        expected = stage_param_counts(plan_model, layout)["expert"] * 8
        if layout.zero_stage == 3:
            expected /= layout.zero_group // layout.ep
        for got in ranks:
            assert got["ledger"]["expert_parameters"] == pytest.approx(expected, rel=0.01)
    # Routing really is spread: the one-sided run sent every token to one expert.
    assert runs[n - 1][0]["probe"][0]["tokens"][1:] == [0.0] * 7
    # Bytes of the token all-to-alls per MoE layer and step (docs/expert_parallel.md):
    # tokens x k x hidden x bytes x 2 directions x 2 passes x (e-1)/e, balanced routing;
    # 3 passes under full recompute.
    for case, ranks, passes in ((BALANCED, runs[-2], 2), (BALANCED_FULL, runs[-1], 3)):
        cfg = case.cfg
        model, e = cfg.model_config(), 4
        tokens = cfg.train.global_batch // 4 * cfg.data.seq_len
        formula = tokens * model.top_k * model.dim * 8 * 2 * passes * (e - 1) / e
        for rank, got in enumerate(ranks):
            step = got["probe"][0]
            measured = step["a2a_bytes"] / step["moe_layers"]
            assert measured == pytest.approx(formula, rel=0.05), (case.id, rank, measured)
    assert not failures, "\n".join(failures)


def test_composed_8_ranks() -> None:
    """dp=2 x tp=2 x pp=2 with ep=2, two microbatches, 8 processes: the MoE
    feed-forwards replicated over tp (ZeRO-1, one MoE block per stage), then their
    experts split over tp x ep (ZeRO-2, four MoE blocks interleaved over two virtual
    stages per rank)."""
    cases = [Case("dp2-tp2-pp2-ep2", moe_cfg(dict(dp=2, tp=2, pp=2, ep=2, zero_stage=1),
                                             train=dict(microbatches=2)), params=True),
             Case("dp2-tp2-pp2-ep2-experts-interleaved",
                  moe_cfg(dict(dp=2, tp=2, pp=2, ep=2, zero_stage=2, moe_tp="experts",
                               virtual_stages=2, schedule="interleaved-1f1b"),
                          train=dict(microbatches=2),
                          n_layers=4, moe_every=1), params=True)]
    runs = run_layouts(cases, 8, STEPS, probe=record_moe, timeout=300)
    failures = _check(cases, runs)
    assert not failures, "\n".join(failures)
