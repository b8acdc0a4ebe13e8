"""The checkpoint format's pure parts: regions, files with checksums, the manifest."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random

import pytest
import torch
from safetensors import safe_open

from partita.checkpoint.files import CRC_BLOCK, CheckpointFileError, FileReader, write_file
from partita.checkpoint.manifest import (
    LATEST,
    complete_checkpoints,
    find_latest,
    is_checkpoint,
    prune,
    read_manifest,
    remove_partials,
    resolve,
    write_latest,
    write_manifest,
)
from partita.checkpoint.regions import Region, RunIndex


def _elements(region: Region) -> torch.Tensor:
    """Global flat indices of the region's elements, the slow and obvious way."""
    ids = torch.arange(math.prod(region.global_shape)).view(region.global_shape)
    if region.dim is not None:
        ids = ids.narrow(region.dim, region.start, region.stop - region.start)
    for dim, start, stop in region.more:
        ids = ids.narrow(dim, start, stop - start)
    return ids.reshape(-1)[region.lo:region.hi]


def _from_runs(region: Region) -> torch.Tensor:
    out = torch.full((region.numel,), -1)
    for g0, g1, off in region.runs():
        out[off:off + g1 - g0] = torch.arange(g0, g1)
    return out


SHAPES = [(12,), (6, 10), (4, 6, 5)]


@pytest.mark.parametrize("shape", SHAPES)
def test_runs_list_exactly_the_regions_elements(shape):
    rng = random.Random(0)
    for _ in range(200):
        dim = rng.choice([None, *range(len(shape))])
        start, stop = (0, 0) if dim is None else sorted(rng.sample(range(shape[dim] + 1), 2))
        local = math.prod(shape) if dim is None else math.prod(shape) // shape[dim] * (stop - start)
        lo, hi = sorted(rng.sample(range(local + 1), 2))
        region = Region(shape, dim, start, stop, lo, hi)
        assert torch.equal(_from_runs(region), _elements(region)), region
        runs = region.runs()
        assert all(a[1] < b[0] for a, b in zip(runs, runs[1:])), "runs increase, never touch"


@pytest.mark.parametrize("shape", [(6, 10), (4, 6, 5), (3, 4, 2, 5)])
def test_runs_of_a_tensor_cut_along_several_dims(shape):
    rng = random.Random(1)
    for _ in range(200):
        dims = sorted(rng.sample(range(len(shape)), rng.choice([2, min(3, len(shape))])))
        cuts = [(d, *sorted(rng.sample(range(shape[d] + 1), 2))) for d in dims]
        cuts = [(d, a, b) if a < b else (d, 0, shape[d]) for d, a, b in cuts]
        rng.shuffle(cuts)  # the first cut need not be the outermost
        local = math.prod(shape)
        for d, a, b in cuts:
            local = local // shape[d] * (b - a)
        lo, hi = sorted(rng.sample(range(local + 1), 2))
        region = Region(shape, *cuts[0], lo, hi, tuple(cuts[1:]))
        assert torch.equal(_from_runs(region), _elements(region)), region
        runs = region.runs()
        assert all(a[1] < b[0] for a, b in zip(runs, runs[1:])), "runs increase, never touch"


def test_pieces_cut_two_ways_reshard_into_a_one_way_cut():
    """An expert stack saved as experts over 2 ranks x widths over 2 (two cuts each),
    read back as experts over 4 ranks and as one whole tensor."""
    shape = (4, 6, 3)
    sources = [Region(shape, 0, 2 * e, 2 * e + 2, 0, 2 * 3 * 3, ((1, 3 * w, 3 * w + 3),))
               for e in range(2) for w in range(2)]
    index = RunIndex(sources)
    values = [_elements(r) for r in sources]
    for target in [Region(shape, 0, e, e + 1, 0, 18) for e in range(4)] + [
            Region(shape, None, 0, 0, 0, 72)]:
        got = torch.full((target.numel,), -1)
        for o in index.find(target):
            got[o.dst:o.dst + o.length] = values[o.source][o.src:o.src + o.length]
        assert torch.equal(got, _elements(target)), target


def _layout_pieces(shape, dim, parts, flat_parts):
    """Pieces of a tensor cut `parts` ways along dim, each cut `flat_parts` ways flat."""
    out = []
    for p in range(parts):
        start, stop = (0, 0) if dim is None else (shape[dim] * p // parts,
                                                  shape[dim] * (p + 1) // parts)
        local = math.prod(shape) if dim is None else math.prod(shape) // shape[dim] * (stop - start)
        for f in range(flat_parts):
            out.append(Region(shape, dim, start, stop, local * f // flat_parts,
                              local * (f + 1) // flat_parts))
    return out


@pytest.mark.parametrize("saved,wanted", [((0, 2, 3), (1, 3, 2)), ((1, 4, 1), (None, 1, 5)),
                                          ((None, 1, 4), (0, 2, 2)), ((1, 3, 2), (1, 2, 3))])
def test_run_index_finds_every_element_of_another_layouts_piece(saved, wanted):
    shape = (6, 12)
    sources = _layout_pieces(shape, *saved)
    index = RunIndex(sources)
    values = [_elements(r) for r in sources]  # a piece's data: its global indices
    for target in _layout_pieces(shape, *wanted):
        got = torch.full((target.numel,), -1)
        for o in index.find(target):
            got[o.dst:o.dst + o.length] = values[o.source][o.src:o.src + o.length]
        assert torch.equal(got, _elements(target)), target


def test_a_gap_shows_as_missing_length():
    shape = (8,)
    index = RunIndex([Region(shape, None, 0, 0, 0, 3), Region(shape, None, 0, 0, 5, 8)])
    assert sum(o.length for o in index.find(Region(shape, None, 0, 0, 0, 8))) == 6


def _tensors():
    return {"a": torch.randn(1000, dtype=torch.float64),
            "b": torch.randn(3, 7).to(torch.bfloat16),
            "big": torch.arange(CRC_BLOCK // 2, dtype=torch.float32),  # two blocks
            "empty": torch.empty(0), "n": torch.tensor([1, 2, 3], dtype=torch.int64)}


def test_files_round_trip_and_open_with_safetensors(tmp_path):
    tensors = _tensors()
    record = write_file(tmp_path / "f.safetensors", tensors, {"k": "v"})
    reader = FileReader(tmp_path / "f.safetensors", record)
    for key, t in tensors.items():
        assert torch.equal(reader.read(key, 0, t.numel()).view(t.shape), t), key
    assert torch.equal(reader.read("big", 1000, 1010), tensors["big"][1000:1010])
    reader.verify_all()
    reader.close()
    with safe_open(str(tmp_path / "f.safetensors"), "pt") as f:  # the standard reader
        assert set(f.keys()) == set(tensors)
        assert torch.equal(f.get_tensor("b"), tensors["b"])
        assert f.metadata() == {"k": "v"}


def test_a_flipped_byte_is_caught_where_it_is_read(tmp_path):
    path = tmp_path / "f.safetensors"
    tensors = _tensors()
    record = write_file(path, tensors)
    big = next(t for t in record.tensors if t.key == "big")
    data = bytearray(path.read_bytes())
    data[big.offset + CRC_BLOCK + 10] ^= 0xFF  # inside big's second block
    path.write_bytes(bytes(data))
    reader = FileReader(path, record)
    assert torch.equal(reader.read("big", 0, 100), tensors["big"][:100])  # first block fine
    with pytest.raises(CheckpointFileError, match=r"f\.safetensors' is corrupt.*'big'"):
        reader.read("big", CRC_BLOCK // 4, CRC_BLOCK // 4 + 10)
    reader.close()


def test_truncated_missing_and_bad_headers_name_the_file(tmp_path):
    path = tmp_path / "f.safetensors"
    record = write_file(path, _tensors())
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(CheckpointFileError, match="truncated"):
        FileReader(path, record)
    path.write_bytes(data[:20] + b"X" + data[21:])
    with pytest.raises(CheckpointFileError, match="corrupt.*header"):
        FileReader(path, record)
    path.unlink()
    with pytest.raises(CheckpointFileError, match="missing"):
        FileReader(path, record)


def _manifest(step: int) -> dict:
    return {"format": "partita-checkpoint", "version": 1, "step": step}


def _checkpoint(root, step):
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True)
    write_manifest(folder, _manifest(step))
    return folder


def test_manifest_checks(tmp_path):
    folder = _checkpoint(tmp_path, 5)
    assert read_manifest(folder)["step"] == 5
    text = (folder / "manifest.json").read_text()
    (folder / "manifest.json").write_text(text.replace('"step": 5', '"step": 6'))
    with pytest.raises(CheckpointFileError, match="corrupt"):
        read_manifest(folder)
    newer = dict(_manifest(5), version=99, partita_version="9.0")
    write_manifest(folder, newer)
    with pytest.raises(CheckpointFileError, match="version 99.*Upgrade partita"):
        read_manifest(folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(CheckpointFileError, match="not a complete checkpoint"):
        read_manifest(folder)
    with pytest.raises(CheckpointFileError, match="does not exist"):
        resolve(tmp_path / "nowhere")


def test_latest_partials_and_pruning(tmp_path):
    assert find_latest(tmp_path) is None
    a, b = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    partial = tmp_path / "step-00000006.abc.partial"
    partial.mkdir()
    (partial / "rank-00000-of-00001.safetensors").write_bytes(b"half")
    broken = tmp_path / "step-00000008"  # a folder whose manifest never arrived
    broken.mkdir()
    assert find_latest(tmp_path) == b
    write_latest(tmp_path, a.name)  # a stale pointer: the newer complete one wins
    assert find_latest(tmp_path) == b
    assert json.loads((b / "manifest.json").read_text())["step"] == 4
    assert resolve(tmp_path) == b and resolve(b) == b
    (tmp_path / LATEST).write_text("garbage")
    assert find_latest(tmp_path) == b
    remove_partials(tmp_path)
    assert not partial.exists()
    c = _checkpoint(tmp_path, 10)
    assert prune(tmp_path, 1, protect=a) == [b]
    assert a.exists() and c.exists() and not b.exists()


def test_a_path_that_holds_no_checkpoint_is_named_as_it_was_given(tmp_path):
    """train.resume's messages name the setting and offer `auto`; `partita checkpoint`'s
    (given_as="") name only the path, which came as an argument."""
    with pytest.raises(CheckpointFileError, match=r"^train.resume='.*nope' does not exist.*"
                                                  r"train.resume=auto"):
        resolve(tmp_path / "nope")
    with pytest.raises(CheckpointFileError, match=r"^'.*' holds no complete checkpoint") as err:
        resolve(tmp_path, given_as="")
    assert "train.resume" not in str(err.value)
    with pytest.raises(CheckpointFileError, match=r"^'.*nope' does not exist") as err:
        resolve(tmp_path / "nope", given_as="")
    assert "train.resume" not in str(err.value)


@pytest.mark.parametrize("left", ["checkpoints", "model.safetensors"])
def test_a_run_folder_that_saved_no_checkpoint_says_how_runs_save_them(tmp_path, left):
    """A run without train.checkpoint_every leaves an empty checkpoints/ folder when it
    dies (the writer makes it at start, for a SIGTERM save), or, finished, removes that
    folder and leaves its weights: say so, not 'give a run's out_dir', which is what
    was given."""
    if left == "checkpoints":
        (tmp_path / "checkpoints").mkdir()
    else:
        (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointFileError) as err:
        resolve(tmp_path, given_as="")
    text = str(err.value)
    assert "is a run folder whose run saved no checkpoint" in text
    assert "train.checkpoint_every=N" in text and "model.safetensors" in text
    assert "train.resume" not in text
    with pytest.raises(CheckpointFileError, match="Start without train.resume"):
        resolve(tmp_path)


def test_a_mixture_of_experts_model_is_recorded_and_checked_by_its_settings(tmp_path):
    from partita.checkpoint.manifest import (
        CheckpointMismatch,
        check_model,
        model_fields,
        routing_changes,
    )
    from partita.models.catalog import get_model_config

    dense, moe = get_model_config("tiny"), get_model_config("tiny-moe")
    saved_moe = {"model": json.loads(json.dumps(model_fields(moe)))}  # as the manifest holds it
    saved_dense = {"model": json.loads(json.dumps(model_fields(dense)))}
    assert saved_dense["model"]["n_experts"] == 0 and "top_k" not in saved_dense["model"]
    assert saved_moe["model"]["n_experts"] == moe.n_experts and "moe_every" in saved_moe["model"]
    # Dense and MoE, either way round, and another expert width: named before launch.
    with pytest.raises(CheckpointMismatch, match="n_experts: checkpoint"):
        check_model(saved_moe, dense, tmp_path)
    with pytest.raises(CheckpointMismatch, match="n_experts: checkpoint 0"):
        check_model(saved_dense, moe, tmp_path)
    wider = dataclasses.replace(moe, expert_ffn_dim=(moe.expert_ffn_dim or moe.ffn_hidden) * 2)
    with pytest.raises(CheckpointMismatch, match="expert_ffn_dim"):
        check_model(saved_moe, wider, tmp_path)
    # Routing may change; it is reported, not refused.
    top1 = dataclasses.replace(moe, top_k=1)
    check_model(saved_moe, top1, tmp_path)
    assert routing_changes(saved_moe, top1) == [f"top_k: {moe.top_k} -> 1"]
    assert routing_changes(saved_moe, moe) == []
    # A manifest written before these keys were recorded is not refused for lacking them.
    old = {"model": {k: v for k, v in saved_moe["model"].items() if k != "n_experts"}}
    check_model({"model": {k: v for k, v in old["model"].items()
                           if k in saved_dense["model"]}}, moe, tmp_path)


def test_widths_are_compared_as_they_resolve(tmp_path):
    """A width left unset and the same width written out build the same weights: the
    resume goes ahead; another width is refused with both resolved figures."""
    from partita.checkpoint.manifest import CheckpointMismatch, check_model, model_fields
    from partita.models.catalog import get_model_config

    for name in ("tiny", "tiny-moe"):
        cfg = dataclasses.replace(get_model_config(name), ffn_dim=None)
        saved = {"model": json.loads(json.dumps(model_fields(cfg)))}
        assert saved["model"]["ffn_dim"] is None
        check_model(saved, dataclasses.replace(cfg, ffn_dim=cfg.ffn_hidden), tmp_path)
        with pytest.raises(CheckpointMismatch,
                           match=f"ffn_dim: checkpoint {cfg.ffn_hidden}, this run "
                                 f"{cfg.ffn_hidden + 64}"):
            check_model(saved, dataclasses.replace(cfg, ffn_dim=cfg.ffn_hidden + 64), tmp_path)
    moe = dataclasses.replace(get_model_config("tiny-moe"), expert_ffn_dim=None)
    saved = {"model": json.loads(json.dumps(model_fields(moe)))}
    check_model(saved, dataclasses.replace(moe, expert_ffn_dim=moe.expert_hidden), tmp_path)
    with pytest.raises(CheckpointMismatch, match="expert_ffn_dim: checkpoint"):
        check_model(saved, dataclasses.replace(moe, expert_ffn_dim=moe.expert_hidden * 2),
                    tmp_path)


def test_a_folder_whose_every_manifest_is_damaged_says_so(tmp_path):
    """Checkpoints whose manifests all fail their checks are named as damaged, by
    resume=auto and by a path alike, not taken for a folder without checkpoints (which
    sent resume=auto to a message asking for resume=auto)."""
    from partita.checkpoint.manifest import NoSoundCheckpoint
    from partita.checkpoint.resume import resume_target
    from partita.config import load_config

    run = tmp_path / "run"
    folder = _checkpoint(run / "checkpoints", 6)
    text = (folder / "manifest.json").read_text()
    (folder / "manifest.json").write_text(text.replace('"step": 6', '"step": 7'))
    assert find_latest(run / "checkpoints") is None
    cfg = load_config(None, [f"--train.out_dir={run}", "--train.resume=auto"])
    with pytest.raises(NoSoundCheckpoint, match=r"^train.resume=auto: every checkpoint .* "
                       r"damaged manifest \(step-00000006\).*corrupt.*--train.overwrite=true"):
        resume_target(cfg)
    for given in (run, run / "checkpoints"):
        with pytest.raises(NoSoundCheckpoint, match="every checkpoint"):
            resolve(given, given_as="")
    _checkpoint(run / "checkpoints", 3)  # a sound older one: resumed from, with a note
    assert resume_target(cfg).name == "step-00000003"


def test_a_stop_request_left_by_the_launcher_is_read_at_install(tmp_path, monkeypatch):
    """A worker that missed the launcher's forwarded SIGTERM (not started yet, or still
    ignoring it) finds the request file at install: it stops after its first step."""
    import signal

    from partita.errors import StopRequest, stop_file

    run_id = f"test-{tmp_path.name}"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        request = StopRequest()
        request.install()
        assert request.signum == 0 and request.installed
        with open(stop_file(run_id), "w"):
            pass
        request = StopRequest()
        request.install()
        assert request.signum == signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
        os.remove(stop_file(run_id))


def test_a_checkpoint_missing_a_file_names_the_newest_whole_one(tmp_path):
    """A newest checkpoint that lost a rank's file is refused, naming the newest older
    checkpoint whose files are all there (not only 'another checkpoint')."""
    from partita.checkpoint.manifest import check_files

    def with_file(step: int, size: int):
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        (folder / "rank-00000-of-00001.safetensors").write_bytes(b"x" * size)
        manifest = dict(_manifest(step), files=[{"name": "rank-00000-of-00001.safetensors",
                                                  "size": size}])
        write_manifest(folder, manifest)
        return folder, manifest

    with_file(3, 8)
    older, _ = with_file(6, 8)
    newest, manifest = with_file(9, 8)
    (older / "rank-00000-of-00001.safetensors").write_bytes(b"x" * 5)  # truncated too
    (newest / "rank-00000-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointFileError, match=r"is missing.*Resume from step-00000003, "
                       r"the newest whole one \(train.resume=.*step-00000003\)"):
        check_files(newest, manifest)


@pytest.fixture(scope="module")
def saved_one_process(tmp_path_factory):
    """A real checkpoint of the parity model, written by one process after 2 steps."""
    from partita.testing import parity_config, single_process, train_layout

    cfg = single_process(parity_config())
    folder = tmp_path_factory.mktemp("one") / "ckpt"
    train_layout(0, 1, cfg, 2, save_to=str(folder))
    return cfg, resolve(folder)


def _edited(tmp_path, saved, edit):
    """A copy of the checkpoint whose manifest `edit` changed and signed again, as a
    hand edit or another tool would leave it: its checksum matches."""
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(saved, copy)
    manifest = read_manifest(copy)
    edit(manifest)
    write_manifest(copy, {k: v for k, v in manifest.items() if k != "crc32"})
    return copy


def _drop_pieces(manifest):
    name = manifest["pieces"][0]["name"]
    manifest["pieces"] = [p for p in manifest["pieces"] if p["name"] != name]


def _drop_rank_file(manifest):
    manifest["files"] = [dict(f, rank=7) for f in manifest["files"]]


@pytest.mark.parametrize("edit", [_drop_pieces, _drop_rank_file],
                         ids=["a parameter's pieces gone", "no file of this rank"])
def test_a_manifest_that_does_not_hold_together_is_refused_clearly(tmp_path,
                                                                  saved_one_process, edit):
    """Its checksum matches, so only its contents can tell: each case used to end in
    a KeyError or StopIteration reported as a fault inside partita."""
    from partita.errors import PartitaError
    from partita.testing import train_layout

    cfg, saved = saved_one_process
    edited = _edited(tmp_path, saved, edit)
    with pytest.raises(PartitaError, match="Resume from another|resume from another"):
        train_layout(0, 1, cfg, 3, resume_from=str(edited))


@pytest.mark.parametrize("step", [-5, "3", 2.5, None])
def test_a_manifest_step_that_is_no_count_is_refused(tmp_path, saved_one_process, step):
    _, saved = saved_one_process
    edited = _edited(tmp_path, saved, lambda m: m.update(step=step))
    with pytest.raises(CheckpointFileError, match="not a step count"):
        read_manifest(edited)


def test_a_roll_back_sets_the_later_branch_aside(tmp_path):
    """Resuming from an older checkpoint of the run's own folder (a roll-back) left the
    newer ones in place: resume=auto then returned to the abandoned branch, and the
    run's saves replaced them one by one. They are renamed, not deleted."""
    from partita.checkpoint.resume import set_aside_later_branch

    root = tmp_path / "checkpoints"
    two, four, six = (_checkpoint(root, s) for s in (2, 4, 6))
    write_latest(root, six.name)
    moved = set_aside_later_branch(two, root)
    assert [p.name.rsplit("-", 1)[0] for p in moved] == ["abandoned-step-00000004",
                                                          "abandoned-step-00000006"]
    assert all(is_checkpoint(p) for p in moved)  # kept whole
    assert complete_checkpoints(root) == [two] and find_latest(root) == two
    assert (root / LATEST).read_text().strip() == two.name
    assert set_aside_later_branch(_checkpoint(tmp_path / "elsewhere", 1), root) == []


def test_a_restart_resumes_what_the_run_saved_after_its_given_checkpoint(tmp_path):
    """With --max-restarts and train.resume=PATH, a restart went back to PATH though the
    run had saved later checkpoints, and redid that work."""
    from partita.checkpoint.resume import resume_target
    from partita.config import load_config

    root = tmp_path / "run" / "checkpoints"
    given = _checkpoint(root, 2)
    cfg = load_config(None, [f"--train.out_dir={tmp_path / 'run'}",
                             f"--train.resume={given}"])
    assert resume_target(cfg, restarted=True) == given  # nothing saved since
    later = _checkpoint(root, 5)
    assert resume_target(cfg, restarted=True) == later
    assert resume_target(cfg) == given  # a first start takes what was asked
    # A checkpoint folder of another run given: this run's older checkpoints stay unused.
    other = _checkpoint(tmp_path / "other", 9)
    cfg = load_config(None, [f"--train.out_dir={tmp_path / 'run'}", f"--train.resume={other}"])
    assert resume_target(cfg, restarted=True) == other
