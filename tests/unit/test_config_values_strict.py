"""A TOML list or table given for a text setting is refused with a message naming the
key (str() made a folder literally named "['runs/a', 'runs/b']"); data.mix keeps the
table form its documentation gives."""

from __future__ import annotations

import pytest

from partita.config import load_config
from partita.config_values import convert_value
from partita.errors import PartitaError


@pytest.mark.parametrize("line,message", [
    ('out_dir = ["runs/a", "runs/b"]', "train.out_dir=['runs/a', 'runs/b'] is a list, not text"),
    ('out_dir = {path = "runs/q"}', "train.out_dir={'path': 'runs/q'} is a table, not text"),
    ('dtype = ["float32"]', "train.dtype=['float32'] is a list, not text"),
])
def test_a_list_or_table_for_a_text_setting_is_refused(tmp_path, line, message):
    path = tmp_path / "run.toml"
    path.write_text(f"[train]\n{line}\n")
    with pytest.raises(PartitaError, match="give text") as refused:
        load_config(path)
    assert message in str(refused.value)


def test_a_list_for_data_source_is_refused_not_read_as_a_path(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[data]\nsource = ["a.txt", "b.txt"]\n')
    with pytest.raises(PartitaError, match=r"data.source=\['a.txt', 'b.txt'\] is a list, not "
                                           "text"):
        load_config(path)


def test_data_mix_keeps_its_table_form_and_refuses_a_list(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[data]\nmix = {"a.jsonl" = 0.7, "b/" = 0.3}\n')
    assert load_config(path).data.mix == "a.jsonl=0.7, b/=0.3"
    path.write_text('[data]\nmix = ["a.jsonl=0.7", "b/=0.3"]\n')
    with pytest.raises(PartitaError, match="data.mix=.* is a list, not text; give text or a "
                                           "TOML table"):
        load_config(path)


def test_text_from_numbers_still_converts():
    assert convert_value("model.name", "tiny", str) == "tiny"
    assert convert_value("train.out_dir", 7, str) == "7"
