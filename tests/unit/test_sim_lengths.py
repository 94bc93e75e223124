"""simulate.lengths = "file:PATH": a file of integers (a dataset's reference lengths)
stands in for the length law; a bad file is a config error naming the key."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec
import pytest

from async_rl.cli import main
from async_rl.config import Config
from async_rl.sim.lengths import length_law, lengths_file
from buffers.common.config import ConfigError
from buffers.common.records import Prompt


def config(lengths: str) -> Config:
    return msgspec.convert({"model": {"path": "not-needed"},
                            "simulate": {"lengths": lengths}}, Config)


def prompt(i: int, attempt: int = 0) -> Prompt:
    return Prompt(prompt_id=f"p{i}", text="x", answer="1", attempt=attempt)


@pytest.mark.parametrize("text", ["12\n40\n900\n", "[12, 40, 900]", "12 40,900"])
def test_a_file_of_lengths_is_drawn_from_as_written(tmp_path: Path, text: str) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    assert lengths_file(str(path)) == [12, 40, 900]
    law = length_law(config(f"file:{path}"))
    drawn = [n for i in range(200) for n in law.completions(prompt(i), 4)]
    assert len(drawn) == 800
    assert set(drawn) == {12, 40, 900}
    assert min(Counter(drawn).values()) > 200  # each about a third
    assert law.completions(prompt(7), 4) == law.completions(prompt(7), 4)  # seeded


def test_one_length_in_the_file_gives_every_sample_that_length(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_text("4096\n")
    law = length_law(config(f"file:{path}"))
    assert law.completions(prompt(0), 8) == (4096,) * 8


@pytest.mark.parametrize(("text", "says"), [
    ("", "holds no lengths"), ("\n \n", "holds no lengths"), ("12 0", "'0' is not"),
    ("12 -3", "'-3' is not"), ("12 4.5", "'4.5' is not"), ("twelve", "'twelve' is not")])
def test_a_file_without_positive_integers_is_a_config_error(
        tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"simulate\.lengths") as error:
        length_law(config(f"file:{path}"))
    assert says in str(error.value)


def test_a_missing_file_exits_2_naming_the_key(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(f'[model]\npath = "not-needed"\n[task]\nkind = "longtail"\n'
                    f'[simulate]\nlengths = "file:{tmp_path}/none.txt"\nparameters = 4e6\n'
                    f'kv_bytes_per_token = 4096\n[run]\noutput_dir = "{tmp_path}/run"\n')
    assert main(["simulate", str(toml)]) == 2
    err = capsys.readouterr().err
    assert "simulate.lengths" in err and "none.txt" in err
