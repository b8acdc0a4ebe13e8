"""Config files, overrides and their errors."""

import pytest

from partita.config import config_from_toml, load_config
from partita.errors import PartitaError


def test_file_then_overrides_and_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nsteps = 50\nlr = 0.01\n[model]\nname = "tiny"\ndim = 64\n')
    cfg = load_config(path, ["--train.steps=7", "--parallel.tp", "2", "--parallel.sequence_parallel"])
    assert (cfg.train.steps, cfg.train.lr, cfg.parallel.tp) == (7, 0.01, 2)
    assert cfg.parallel.sequence_parallel is True
    assert cfg.model_config().dim == 64
    assert config_from_toml(cfg.to_toml()) == cfg


def test_unknown_keys_name_the_closest_valid_key(tmp_path):
    with pytest.raises(PartitaError, match="Did you mean 'train.steps'"):
        load_config(None, ["--train.stepz=3"])
    with pytest.raises(PartitaError, match="Did you mean 'parallel.zero_stage'"):
        load_config(None, ["--paralel.zero_stage=1"])
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nlearning_rate = 1\n")
    with pytest.raises(PartitaError, match="unknown setting 'train.learning_rate'. Did you "
                                           "mean 'train.lr' .partita's name for it."):
        load_config(path)


def test_other_trainers_names_point_at_real_settings():
    from partita.config import PEER_NAMES, _all_keys

    cfg = load_config()
    for peer, ours in PEER_NAMES.items():
        assert ours in _all_keys(), ours
        section = next(s for s in ("train", "parallel", "data")
                       if not hasattr(getattr(cfg, s), peer))
        with pytest.raises(PartitaError, match=f"Did you mean '{ours}'"):
            load_config(None, [f"--{section}.{peer}=1"])


def test_bad_values_and_files():
    with pytest.raises(PartitaError, match="not an integer"):
        load_config(None, ["--train.steps=many"])
    with pytest.raises(PartitaError, match="true or false"):
        load_config(None, ["--train.progress=maybe"])
    with pytest.raises(PartitaError, match="does not exist"):
        load_config("/nonexistent/run.toml")
    with pytest.raises(PartitaError, match="--section.key=value"):
        load_config(None, ["steps=3"])
    # A key without its section names the section(s) that have it, or the peer's name.
    with pytest.raises(PartitaError, match="Did you mean 'train.lr'[?]"):
        load_config(None, ["--lr", "3"])
    with pytest.raises(PartitaError, match="Did you mean 'model.seed' or 'data.seed'"):
        load_config(None, ["--seed=3"])
    with pytest.raises(PartitaError, match="Did you mean 'train.lr' .partita's name"):
        load_config(None, ["--learning_rate=3"])


def test_toml_booleans_are_not_numbers(tmp_path):
    # TOML's `true` would pass int() as 1; the command line refuses it, so must the file.
    for key, kind in (("steps", "not an integer"), ("lr", "not a number")):
        path = tmp_path / f"{key}.toml"
        path.write_text(f"[train]\n{key} = true\n")
        with pytest.raises(PartitaError, match=kind):
            load_config(path)


def test_invalid_toml(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[train\nsteps=")
    with pytest.raises(PartitaError, match="not valid TOML"):
        load_config(path)


def test_relative_input_paths_are_stored_absolute(tmp_path, monkeypatch):
    """A run's config.toml names its inputs absolutely, so `partita generate --run` and
    `partita export` read the same files from any working directory; names that are no
    path from here (built-in ones) stay as given."""
    from partita.config import load_config
    from partita.run_dir import with_absolute_inputs

    (tmp_path / "hf").mkdir()
    (tmp_path / "a.jsonl").write_text("{}")
    monkeypatch.chdir(tmp_path)
    cfg = with_absolute_inputs(load_config(None, [
        "--data.tokenizer=hf", "--data.mix=a.jsonl=0.7, gone.jsonl=0.3"]))
    assert cfg.data.tokenizer == str(tmp_path / "hf")
    assert cfg.data.mix == f"{tmp_path / 'a.jsonl'}=0.7, gone.jsonl=0.3"
    assert cfg.data.source == "" and cfg.model.init_from == ""
    # A source whose name holds a comma stays one source.
    (tmp_path / "x,y.jsonl").write_text("{}")
    cfg = with_absolute_inputs(load_config(None, ["--data.mix=x,y.jsonl=1, a.jsonl=2"]))
    assert cfg.data.mix == f"{tmp_path / 'x,y.jsonl'}=1, {tmp_path / 'a.jsonl'}=2"


def test_a_resume_with_another_learning_rate_schedule_is_named():
    """Resuming with other steps, lr, min_lr or warmup reshapes the schedule from the
    checkpoint's step on: the note names each change; the same settings, none."""
    from partita.commands.train_notes import schedule_changes
    from partita.config import load_config

    trained = {"config": load_config(None, ["--train.steps=4"]).to_toml()}
    assert schedule_changes(trained, load_config(None, ["--train.steps=4"])) == []
    assert schedule_changes(trained, load_config(None, [
        "--train.steps=8", "--train.lr=0.001"])) == ["train.steps 4 -> 8",
                                                     "train.lr 0.003 -> 0.001"]
    assert schedule_changes({}, load_config(None, [])) == []


@pytest.mark.parametrize("value", ["1.5e0", "2.9e0", "1e-1", "1e400", "9.3e18", "inf", "nan"])
def test_an_integer_with_an_exponent_must_be_integral_and_fit(value):
    """"1.5e0" was truncated to 1 and "1e400" raised OverflowError."""
    with pytest.raises(PartitaError, match=r"train.steps='.*' is (not an integer|too large)"):
        load_config(None, [f"--train.steps={value}"])


def test_an_integral_exponent_is_an_integer(tmp_path):
    assert load_config(None, ["--train.steps=1e3"]).train.steps == 1000
    assert load_config(None, ["--train.global_batch=2.0e1"]).train.global_batch == 20
    path = tmp_path / "run.toml"
    path.write_text("[train]\nsteps = 1e400\n")  # TOML reads it as float infinity
    with pytest.raises(PartitaError, match="not an integer"):
        load_config(path)


def test_a_config_path_that_is_a_folder_or_not_utf8_is_named_as_such(tmp_path):
    with pytest.raises(PartitaError, match="is a folder; give the path of a TOML file"):
        load_config(tmp_path)
    path = tmp_path / "run.toml"
    path.write_bytes(b"[train]\nsteps = 3 # caf\xe9\n")
    with pytest.raises(PartitaError, match=r"not UTF-8 text \(byte 23 is 0xe9\)"):
        load_config(path)


def test_a_dp_that_does_not_fill_the_world_is_named_before_the_batch() -> None:
    # dp=3 on 4 processes: the batch of 16 that 3 does not divide is only a consequence.
    from partita.config import Config
    from partita.errors import PartitaError

    cfg = Config()
    cfg.parallel.dp = 3
    with pytest.raises(PartitaError, match="needs 3 processes but 4 were started") as got:
        cfg.layout(4)
    assert "global_batch" not in str(got.value)
    assert "--parallel.dp=4" in str(got.value)


def test_the_shape_a_run_starts_with_names_what_the_catalog_entry_gave():
    # dim and heads set, the rest from `tiny`: its 2 kv heads (4:1 grouped attention
    # here) and its vocabulary are said, not left to be found in the weights.
    from partita.config import load_config

    cfg = load_config(None, ["--model.dim=256", "--model.n_heads=8"]).model_config()
    assert cfg.shape_text() == ("llama, 4 layers, dim 256, 8 heads (2 kv), ffn 704, "
                                "vocab 256, max_seq_len 128")
    moe = load_config(None, ["--model.name=tiny-moe"]).model_config()
    assert "8 experts (top 2, width 384, every 2 blocks)" in moe.shape_text()


def test_with_overrides_copies_and_checks():
    from partita.config import with_overrides

    base = load_config(None, ["--train.steps=7"])
    changed = with_overrides(base, ["--parallel.zero_stage=3", "--train.microbatches=2"])
    assert (changed.parallel.zero_stage, changed.train.microbatches, changed.train.steps) \
        == (3, 2, 7)
    assert (base.parallel.zero_stage, base.train.microbatches) == (0, 1)  # untouched
    with pytest.raises(PartitaError, match="unknown setting"):
        with_overrides(base, ["--parallel.zero_stag=3"])
