"""docs/models.md's generator (scripts/model_matrix.py): each cell is what a test row
recorded, and a row no test ran is "not run", never a claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_modules import load_script

from async_rl.models.families import ARCHITECTURES

matrix = load_script("scripts/model_matrix.py", "model_matrix")

REPORT = f"""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.unit.test_model_matrix" name="{matrix.VALUES}[llama]"/>
<testcase classname="tests.unit.test_model_matrix" name="{matrix.GRADIENTS}[llama]"/>
<testcase classname="tests.unit.test_model_matrix" name="{matrix.LORA}[llama]">
  <properties><property name="lora_targets" value="q_proj, k_proj"/>
  <property name="lora_lacking" value="gate_proj"/></properties></testcase>
<testcase classname="tests.unit.test_model_matrix" name="{matrix.VALUES}[granite]">
  <failure message="AssertionError: log-probs up to 0.75 from the model's own&#10;more">
  trace</failure></testcase>
<testcase classname="tests.unit.test_model_matrix" name="{matrix.GRADIENTS}[granite]"/>
<testcase classname="tests.unit.test_model_matrix" name="{matrix.LORA}[granite]">
  <error message="failed on setup with &quot;ValueError: no | way&quot;">trace</error>
</testcase>
<testcase classname="tests.unit.test_model_matrix" name="{matrix.REFUSAL}[gemma2]">
  <properties><property name="reason" value="gemma2: attention soft-capping"/>
  </properties></testcase>
<testcase classname="tests.unit.test_model_matrix" name="{matrix.REFUSAL}[mamba2]">
  <properties><property name="reason" value="mamba2: state-space"/></properties></testcase>
<testcase classname="tests.unit.test_model_matrix" name="{matrix.REFUSAL}[lfm2]">
  <failure message="AssertionError: no refusal">trace</failure></testcase>
<testcase classname="tests.unit.test_model_matrix" name="test_no_family"/>
</testsuite></testsuites>
"""


def rows(page: str) -> dict[str, list[str]]:
    families = page.split("## Refused at start")[0]
    table = [line for line in families.splitlines() if line.startswith("| ")][1:]
    cells = {}
    for line in table:
        parts = [p.strip() for p in line.strip("|").split(" | ")]
        cells[parts[0].split(" ")[0]] = parts[1:]
    return cells


def test_each_cell_is_a_recorded_outcome(tmp_path: Path) -> None:
    report = tmp_path / "trainer.xml"
    report.write_text(REPORT)
    cases = matrix.read_report(report)
    assert len(cases) == 9  # the case without an architecture is not a row
    page = matrix.render(cases, {"llama": "exact", "gemma2": "not on CPU: no kernel"})
    cells = rows(page)
    assert list(cells) == list(ARCHITECTURES)
    assert cells["llama"][:3] == ["exact", "exact",
                                  "exact on q_proj, k_proj (gate_proj: not linear layers here)"]
    granite = cells["granite"]
    assert granite[0] == "fails: AssertionError: log-probs up to 0.75 from the model's own"
    assert granite[1] == "not run"
    assert granite[2] == 'fails: failed on setup with "ValueError: no \\| way"'
    gemma2 = cells["gemma2"]
    assert gemma2[:3] == ["refused", "not on CPU: no kernel", "—"]
    assert gemma2[3].startswith("refused: gemma2: attention soft-capping. ")
    assert cells["qwen2"][:3] == ["not run"] * 3
    assert f"{len(ARCHITECTURES)} architectures; in the trainer 1 train exactly, 1 are" in page
    others = page.split("## Refused at start")[1]
    assert "| lfm2 | fails: AssertionError: no refusal |" in others
    assert "| mamba2 | mamba2: state-space |" in others


def test_the_script_reads_the_engine_rows_file_and_writes_the_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, engine = tmp_path / "trainer.xml", tmp_path / "engine.json"
    report.write_text(REPORT)
    engine.write_text(json.dumps({"qwen2": "refused: qwen2: no"}))
    out = tmp_path / "models.md"
    monkeypatch.setattr(matrix, "DOCS_PATH", out)
    assert matrix.main(["--junit", str(report), "--engine", str(engine)]) == 0
    assert rows(out.read_text())["qwen2"][1] == "refused: qwen2: no"
    assert matrix.main(["--junit", str(report), "--engine", str(tmp_path / "none")]) == 0
    assert rows(out.read_text())["qwen2"][1] == "not run"
