"""The search's memoisation (`partita.planner.memo`) changes no number.

Each memoised term names the layout fields it does not read; a wrong name would hand
one layout another's result. So every memoised call a search makes (hits included:
a hit is a result computed for another layout) is recomputed afresh and compared, for
requests that exercise every kind of layout: dense and mixture-of-experts models (with
dense blocks between MoE ones), pipelines and their schedules, context and expert
parallelism, ZeRO stages and offload, partita's own implementation, compiled blocks,
ZeRO-3's kept units and fp32.
"""

import copy
import importlib
import sys

import pytest

from partita.layout import CP_KINDS, MOE_TP, OFFLOAD, RECOMPUTE, SCHEDULES, Layout
from partita.planner import evaluate, make_request
from partita.planner.evaluate import add_step_time
from partita.planner.memo import memoised, memoising
from partita.planner.search import SearchSpace, search

memo = importlib.import_module("partita.planner.memo")

REQUESTS = {
    "moe, every option": dict(model="tiny-moe", gpus=8, seq_len=128, global_batch=64,
                              implementation="partita"),
    "dense, compiled, kept units": dict(model="tiny", gpus=16, seq_len=128, global_batch=32,
                                        implementation="partita", compile="blocks",
                                        keep_gathered="auto"),
    "gpt2, fp32": dict(model="tiny-gpt2", gpus=8, seq_len=128, global_batch=64,
                       precision="fp32"),
}


def _request(model, gpus, implementation=None, **options):
    from partita.planner.assumptions import Assumptions

    if implementation == "partita":
        options["assumptions"] = Assumptions.partita_on_gpu()
    return make_request(model, gpus, **options)


def _record_memoised_calls(monkeypatch) -> list:
    """Every call of a memoised function of the planner, with what it returned."""
    calls = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("partita.planner") or module is None:
            continue
        for attr, fn in list(vars(module).items()):
            if callable(fn) and hasattr(fn, "uncached") and getattr(fn, "__module__", "") \
                    .startswith("partita.planner"):
                def recording(*args, _fn=fn, **kwargs):
                    result = _fn(*args, **kwargs)
                    # As handed out: callers may change what they get (their copy).
                    calls.append((_fn, args, kwargs, copy.deepcopy(result)
                                  if isinstance(result, dict | list) else result))
                    return result
                monkeypatch.setattr(module, attr, recording)
    return calls


@pytest.mark.parametrize("case", REQUESTS)
def test_memoised_terms_equal_fresh_ones(case, monkeypatch):
    req = _request(**REQUESTS[case])
    calls = _record_memoised_calls(monkeypatch)
    result = search(req, SearchSpace.everything())
    monkeypatch.undo()  # record no more
    assert result.ranked and calls
    checked = set()
    # Each body runs afresh; the memoised terms it calls answer from a scope of their
    # own, checked in turn as they were recorded too.
    with memoising():
        for fn, args, kwargs, got in calls:
            if not any(isinstance(a, Layout) for a in (*args, *kwargs.values())):
                continue
            key = (fn, args, tuple(kwargs.items()))
            if key in checked:
                continue
            checked.add(key)
            assert fn.uncached(*args, **kwargs) == got, (fn.__qualname__, args)
    assert len(checked) > 1000


def _other(layout: Layout, name: str) -> Layout:
    """`layout` with field `name` changed (degrees so that the layout stays valid)."""
    value = getattr(layout, name)
    options = {"zero_stage": (0, 1, 2, 3), "schedule": SCHEDULES, "recompute": RECOMPUTE,
               "offload": OFFLOAD, "cp_kind": CP_KINDS, "moe_tp": MOE_TP}
    if name in options:
        other = options[name][(options[name].index(value) + 1) % len(options[name])]
    elif isinstance(value, bool):
        other = not value
    elif name == "ep":
        other = 1 if value > 1 else layout.dp * layout.cp
    else:  # a degree times 2 keeps ep dividing dp x cp; counts simply grow
        other = 2 * value if name in ("dp", "tp", "pp", "cp") else value + 1
    return layout.with_(**{name: other})


@pytest.mark.parametrize("case", REQUESTS)
def test_memoised_terms_read_no_field_they_ignore(case, monkeypatch):
    # Within one search some fields never vary on their own (sequence parallelism
    # follows tp), so a wrong `ignores` there would not show above: each term is also
    # called with every field it ignores changed, and must not notice.
    req = _request(**REQUESTS[case])
    calls = _record_memoised_calls(monkeypatch)
    search(req, SearchSpace.everything())
    monkeypatch.undo()
    seen: dict = {}
    for fn, args, kwargs, _ in calls:
        where = [i for i, a in enumerate(args) if isinstance(a, Layout)]
        if where and fn.ignores:
            seen.setdefault(fn, []).append((where[0], args, kwargs))
    assert len(seen) > 10
    for fn, every in seen.items():
        for i, args, kwargs in every[::max(1, len(every) // 40)]:  # across the search
            expected = fn.uncached(*args, **kwargs)
            for name in fn.ignores:
                changed = (*args[:i], _other(args[i], name), *args[i + 1:])
                assert fn.uncached(*changed, **kwargs) == expected, (fn.__qualname__, name)


@pytest.mark.parametrize("case", REQUESTS)
def test_searched_layouts_equal_lone_evaluations(case):
    # What the search ranks, models and shows as examples is what `partita plan
    # --layout` prints for the same layout (evaluated alone, nothing memoised).
    req = _request(**REQUESTS[case])
    result = search(req, SearchSpace.everything())
    shown = [*result.ranked[::50], *result.modelled[:20],
             *(e for examples in result.examples.values() for e in examples)]
    for ev in shown:
        alone = evaluate(req, ev.layout)
        if not ev.memory:  # ruled out on its degrees alone: never evaluated
            assert ev.reasons and not ev.time
            continue
        assert alone.to_dict() == ev.to_dict()


def test_untimed_evaluation_is_the_timed_one_less_its_time():
    req = _request(**REQUESTS["moe, every option"])
    for layout in (Layout(dp=16), Layout(dp=4, tp=2, pp=2, ep=2, zero_stage=2,
                                         sequence_parallel=True, microbatch_size=2),
                   Layout(dp=8, pp=2, schedule="zb-h1", recompute="full")):
        timed = evaluate(req, layout)
        untimed = evaluate(req, layout, timed=False)
        assert untimed.time == {} and untimed.reasons == timed.reasons
        assert add_step_time(req, untimed).to_dict() == timed.to_dict()


def test_memoising_is_scoped_and_hands_out_copies():
    calls = []

    @memoised(ignores=("zero_stage",))
    def states(layout: Layout) -> dict:
        calls.append(layout)
        return {"tp": layout.tp, "units": [1.0]}

    states(Layout())
    states(Layout())
    assert len(calls) == 2  # outside a search: computed every time
    with memoising():
        first = states(Layout(zero_stage=1))
        first["tp"] = 99
        first["units"].append(2.0)
        again = states(Layout(zero_stage=2))  # an ignored field: the same entry
        assert again == {"tp": 1, "units": [1.0]} and len(calls) == 3
        states(Layout(tp=2, dp=1, sequence_parallel=True))
        assert len(calls) == 4
    states(Layout())
    assert len(calls) == 5 and memo._ACTIVE.get() is None


def test_keys_tell_numbers_of_different_types_apart():
    @memoised()
    def kind(x: object) -> str:
        return type(x).__name__

    with memoising():
        assert [kind(1), kind(1.0), kind(True)] == ["int", "float", "bool"]


def test_an_unknown_ignored_field_is_refused():
    with pytest.raises(ValueError, match="not fields of Layout: zero"):
        memoised(ignores=("zero",))


def test_a_search_keys_few_objects_by_identity(monkeypatch):
    # Objects are known by identity, so one made afresh for every layout (a copy of
    # the assumptions, a dense-block view of the model) would never be found again and
    # would pile up: what derives them is memoised too.
    scopes = []
    real = memo.memoising

    def spying():
        scope = real()
        scopes.append(scope)
        return scope

    search_module = importlib.import_module("partita.planner.search")
    monkeypatch.setattr(search_module, "memoising", spying)
    held = []
    real_token = memo._Memo.token

    def token(self, obj):
        held.append(type(obj).__name__) if id(obj) not in self.by_id else None
        return real_token(self, obj)

    monkeypatch.setattr(memo._Memo, "token", token)
    for case in REQUESTS:
        held.clear()
        search(_request(**REQUESTS[case]), SearchSpace.everything())
        assert 0 < len(held) < 20, (case, held)
    assert scopes
