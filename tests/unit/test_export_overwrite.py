"""`partita export --overwrite` replaces an earlier export and nothing else: a run's
folder, a checkpoint or a folder of one's own is refused with what it holds and left as
it was. Also the messages of an empty --out, an --out that is a file and a folder that
cannot be written."""

import errno
import json
from pathlib import Path

import pytest

from partita.errors import PartitaError
from partita.export import INDEX, export_hf, export_run
from partita.models.model_config import ModelConfig
from partita.models.transformer import build_model

CFG = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2)


@pytest.fixture(scope="module")
def state():
    return build_model(CFG).state_dict()


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"/"
            for p in sorted(folder.rglob("*"))}


def test_an_earlier_export_is_replaced(tmp_path, state):
    out = export_hf(state, CFG, tmp_path / "hf")
    (out / "config.json").write_text("{}")  # marks the old one
    export_hf(state, CFG, out, overwrite=True)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 16
    assert (out / INDEX).is_file()


def test_a_run_folder_is_not_replaced(tmp_path, state):
    victim = tmp_path / "victim"
    (victim / "checkpoints" / "step-00000002").mkdir(parents=True)
    (victim / "config.toml").write_text("[model]\n")
    (victim / "notes.txt").write_text("mine")
    before = tree(victim)
    with pytest.raises(PartitaError) as refused:
        export_hf(state, CFG, victim, overwrite=True)
    assert str(refused.value) == (
        f"--out '{victim}' looks like a run's folder: it holds checkpoints/, config.toml, "
        "notes.txt. --overwrite replaces only an earlier export, so nothing was touched; "
        "choose another --out folder, or move or delete what it holds yourself if it is "
        "no longer needed.")
    assert tree(victim) == before
    assert not (tmp_path / "victim.partial").exists()


def test_a_checkpoint_and_a_folder_of_ones_own_are_not_replaced(tmp_path, state):
    checkpoint = tmp_path / "step-00000004"
    checkpoint.mkdir()
    (checkpoint / "manifest.json").write_text("{}")
    (checkpoint / "rank-00000.bin").write_text("x")
    mine = tmp_path / "mine"
    mine.mkdir()
    for i in range(8):
        (mine / f"f{i}.txt").write_text(str(i))
    for folder, what in ((checkpoint, "is a checkpoint: it holds manifest.json, "
                                      "rank-00000.bin."),
                         (mine, f"is not an earlier export (it has no {INDEX}): it holds "
                                "f0.txt, f1.txt, f2.txt, f3.txt, f4.txt, f5.txt and 2 more.")):
        before = tree(folder)
        with pytest.raises(PartitaError, match="^" + f"--out '{folder}' {what}".replace(
                "(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            export_hf(state, CFG, folder, overwrite=True)
        assert tree(folder) == before


def test_an_export_with_other_files_added_is_not_replaced(tmp_path, state):
    out = export_hf(state, CFG, tmp_path / "hf")
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    with pytest.raises(PartitaError, match="is an export with files an export does not "
                                           "write: it holds .*notes.txt"):
        export_hf(state, CFG, out, overwrite=True)
    assert tree(out) == before


def test_export_run_refuses_before_reading_the_weights(tmp_path, monkeypatch):
    from partita import weights
    from partita.config import load_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(load_config(None, ["--model.dim=16", "--model.n_layers=1",
                                                        "--model.n_heads=2"]).to_toml())
    (run / "model.safetensors").write_text("not read")
    monkeypatch.setattr(weights, "load_weights", lambda *a: pytest.fail("weights read"))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.toml").write_text("")
    with pytest.raises(PartitaError, match="looks like a run's folder"):
        export_run(run, victim, overwrite=True)


def test_an_export_with_a_tokenizer_file_of_its_own_name_is_replaced(tmp_path, state):
    tokenizer = tmp_path / "my-tokenizer.json"
    tokenizer.write_text("{}")
    out = export_hf(state, CFG, tmp_path / "hf", tokenizer=tokenizer)
    assert (out / "my-tokenizer.json").is_file()
    export_hf(state, CFG, out, tokenizer=tokenizer, overwrite=True)


def test_an_empty_out_is_refused_not_read_as_the_current_folder(tmp_path, monkeypatch,
                                                                 state):
    monkeypatch.chdir(tmp_path)
    for call in (lambda: export_run(tmp_path / "run", "", overwrite=True),
                 lambda: export_hf(state, CFG, "", overwrite=True)):
        with pytest.raises(PartitaError, match="^--out is empty: give the folder"):
            call()
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_a_file_is_named_so(tmp_path, state):
    (tmp_path / "x").write_text("mine")
    with pytest.raises(PartitaError, match="is a file, not a folder"):
        export_hf(state, CFG, tmp_path / "x", overwrite=True)
    assert (tmp_path / "x").read_text() == "mine"


def test_a_folder_that_cannot_be_written_is_not_blamed_on_disk_space(tmp_path, monkeypatch,
                                                                     state):
    def refuse(self, *args, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(PartitaError) as refused:
        export_hf(state, CFG, tmp_path / "hfx")
    message = str(refused.value)
    assert message == (f"writing the export to '{tmp_path / 'hfx'}' failed (Operation not "
                       f"permitted); nothing was left behind. The folder '{tmp_path}' cannot "
                       "be written: choose an --out in a folder you can write to.")
    assert "disk space" not in message
