"""Renders docs/models.md, the model matrix, from a run of its tests.

Owns: running the trainer rows (``tests/unit/test_model_matrix.py``, under pytest with a
JUnit XML report), reading that report and the engine rows' JSON, and rendering the
table (architecture, trainer, engine, LoRA, notes) with how to add a family. Every cell
comes from an outcome a test recorded; a row no test ran says "not run".

    python scripts/model_matrix.py                # run the trainer rows, write docs/models.md
    python scripts/model_matrix.py --junit FILE   # render from an earlier run's report
    python scripts/model_matrix.py --print        # print the page instead of writing it

Inputs (under ``runs/model-matrix/``, outside git):

- ``trainer.xml``: pytest's JUnit XML of the trainer rows. A family's trainer cell is
  "exact" when its log-prob/entropy and gradient rows passed, "refused" when its
  refusal row passed (the reason is in the notes), else "fails" with the first line of
  the failure; the LoRA cell the same from its LoRA row, naming the targets it ran on
  (its ``lora_targets`` property) and the default targets the family lacks.
- ``engine.json``, written by the engine rows (``ENGINE_TESTS``): one object,
  ``{"<architecture>": "<outcome>"}``, the outcome being ``"exact"`` (vLLM's log-probs of
  the tokens equal the model's own within the engine/trainer agreement tolerance),
  ``"refused: <one-line reason>"`` or ``"not on CPU: <vLLM's error, one line>"``. An
  architecture it does not name, or no file at all, is "not run".
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = "tests/unit/test_model_matrix.py"
ENGINE_TESTS = "tests/integration/test_model_matrix_engine.py"
OUT_DIR = ROOT / "runs" / "model-matrix"
DOCS_PATH = ROOT / "docs" / "models.md"
COMMAND = "python scripts/model_matrix.py"

VALUES = "test_packed_logprobs_and_entropy_equal_the_padded_eager_forward"
GRADIENTS = "test_packed_gradients_equal_the_padded_eager_forward"
LORA = "test_with_lora_packed_logprobs_and_adapter_gradients_equal_the_padded"
REFUSAL = "test_a_refused_model_stops_at_start_in_one_line"
NOT_RUN = "not run"


@dataclass(frozen=True)
class Case:
    """One test row of the report: passed, or the first line of why not."""

    passed: bool
    message: str
    properties: Mapping[str, str]


MESSAGE_CHARS = 160
"""A failure's message in the table: its first line, cut to this many characters."""


def _first_line(problem: ET.Element) -> str:
    lines = (problem.get("message") or "").strip().splitlines()
    line = lines[0] if lines else problem.tag
    return line if len(line) <= MESSAGE_CHARS else line[:MESSAGE_CHARS - 3] + "..."


def read_report(path: Path) -> dict[tuple[str, str], Case]:
    """The JUnit XML's cases by (test function, architecture)."""
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        found = re.fullmatch(r"(\w+)\[(\w+)\]", case.get("name", ""))
        if not found:
            continue
        problems = [case.find(tag) for tag in ("failure", "error", "skipped")]
        problem = next((p for p in problems if p is not None), None)
        properties = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        cases[found[1], found[2]] = Case(
            passed=problem is None, message="" if problem is None else _first_line(problem),
            properties=properties)
    return cases


def _cell(cases: list[Case | None]) -> str:
    if any(case is None for case in cases):
        return NOT_RUN
    failed = [case for case in cases if case is not None and not case.passed]
    return "exact" if not failed else f"fails: {failed[0].message}"


def trainer_cell(cases: Mapping[tuple[str, str], Case], arch: str) -> str:
    refusal = cases.get((REFUSAL, arch))
    if refusal is not None:
        return "refused" if refusal.passed else f"fails: {refusal.message}"
    return _cell([cases.get((VALUES, arch)), cases.get((GRADIENTS, arch))])


def lora_cell(cases: Mapping[tuple[str, str], Case], arch: str) -> str:
    case = cases.get((LORA, arch))
    if case is None:
        return "—" if (REFUSAL, arch) in cases else NOT_RUN
    cell = _cell([case])
    lacking = case.properties.get("lora_lacking")
    if cell == "exact" and lacking:
        cell += (f" on {case.properties.get('lora_targets', '')} ({lacking}: not linear "
                 "layers here)")
    return cell


def _refusal(case: Case) -> str:
    """A refusal row's cell: the reason its test saw the check give, or why it failed."""
    return case.properties.get("reason", "") if case.passed else f"fails: {case.message}"


def engine_cell(engine: Mapping[str, str], arch: str) -> str:
    return engine.get(arch, NOT_RUN)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(cases: Mapping[tuple[str, str], Case], engine: Mapping[str, str]) -> str:
    """docs/models.md."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from async_rl.models.families import ARCHITECTURES, FEATURES, model_type

    rows = []
    trainer_cells = []
    for arch in ARCHITECTURES:
        trainer = trainer_cell(cases, arch)
        trainer_cells.append(trainer)
        notes = FEATURES[arch]
        refusal = cases.get((REFUSAL, arch))
        if trainer == "refused" and refusal is not None:
            notes = f"refused: {refusal.properties.get('reason', '')}. {notes}"
        name = arch if model_type(arch) == arch else f"{arch} ({model_type(arch)})"
        rows.append(f"| {name} | {_escape(trainer)} | {_escape(engine_cell(engine, arch))} "
                    f"| {_escape(lora_cell(cases, arch))} | {_escape(notes)} |")
    others = [f"| {name} | {_escape(_refusal(case))} |"
              for (test, name), case in sorted(cases.items())
              if test == REFUSAL and name not in ARCHITECTURES]
    return TEMPLATE.format(
        others="\n".join(others) or f"| (none) | {NOT_RUN} |",
        command=COMMAND, tests=TESTS, engine_tests=ENGINE_TESTS, total=len(ARCHITECTURES),
        exact=trainer_cells.count("exact"), refused=trainer_cells.count("refused"),
        failing=len(ARCHITECTURES) - trainer_cells.count("exact")
        - trainer_cells.count("refused"), rows="\n".join(rows))


TEMPLATE = """\
# Model families

<!-- generated by `{command}` from a run of the model matrix: do not edit by hand -->

Which Hugging Face architectures the trainer computes exactly, which it refuses at
start, and which vLLM's CPU build serves. Each row is a tiny random model of the family
(`async_rl/models/families.py`: head_dim 32, 2 layers, the family's distinctive feature
switched on) checked by a test; nothing here is claimed that a test did not check.

- **trainer** (`{tests}`, unit tier): on a micro-batch of four sequences of unequal
  lengths (one completion of a single token, rows past the sliding window), the packed
  path (`trainer.packed = true`: packed attention, the fused LM head) gives the model's
  own padded eager forward's log-probs and entropies to 1e-5 and every parameter's
  gradient to 1e-5 relative, in fp32: **exact**. Or the run stops at start in one line
  (exit 2) naming the family and the feature: **refused** (the reason is in the notes;
  `trainer.packed = false` trains it on the model's own attention and head).
- **engine** (`{engine_tests}`, integration tier): vLLM's CPU build (fp32, eager)
  scores three token sequences (9 to 30 tokens, past the sliding window) and generates
  12 greedy tokens; its log-probs equal the model's own eager fp32 forward within abs
  1e-4, the engine/trainer agreement tolerance (`assert_behaviour_logprobs` in
  `tests/integration/test_rollout.py`); and after a new version (every weight
  perturbed, under the names the trainer sends) is loaded into the running engine as a
  run loads one, they equal the perturbed model's: **exact**. Or a version cannot reach
  the engine and a run stops at start in one line unless only LoRA adapters train
  (**refused**, with the line; the row checks that the version really does not reach
  it), or vLLM's CPU build cannot serve it (**not on CPU**, with its error, which the
  row asserts).
- **LoRA**: the trainer row again with rank-8 adapters (drawn non-zero) on the default
  `model.lora.target_modules` the family has as linear layers. Default targets a family
  lacks (MoE experts held in fused tensors, phi3's fused projections) are refused at
  start by the `model.lora.target_modules` check: name the family's own there.

{total} architectures; in the trainer {exact} train exactly, {refused} are refused and
{failing} fail or were not run.

| architecture | trainer | engine | LoRA | notes |
|---|---|---|---|---|
{rows}

## Refused at start

Models outside the families above that the packed path must not train, each a row of
the same test: the one line `async-rl train` stops with (exit 2), which names the
feature. `trainer.packed = false` trains them on the model's own layers (not checked
here).

| model | refusal |
|---|---|
{others}

## How to add a family

1. Add it to `async_rl/models/families.py`: its name in `ARCHITECTURES`, its tiny
   config's keywords in `FAMILY_KEYWORDS` (its distinctive feature switched on, and
   strong enough to show on a random model), a line in `FEATURES`, and its
   `model_type` in `MODEL_TYPES` if the causal LM is a text-only model.
2. Run the matrix: `python -m pytest {tests} -q` (the trainer rows), and the engine
   rows: `python -m pytest {engine_tests} -q` (a minute or two; it writes
   `runs/model-matrix/engine.json`). A feature the packed path cannot compute is refused in
   `workers/trainer/packed_support.py` (one line naming the family and the feature),
   never left as a silent difference.
3. Regenerate this page: `{command}` (it runs the trainer rows and reads the engine
   rows' `runs/model-matrix/engine.json`).
"""


def run_trainer_rows(report: Path) -> str:
    """The trainer rows under pytest, their report in ``report``; pytest's summary line
    (failing rows are outcomes too: its exit status is no error here)."""
    report.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", TESTS, "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}", "-o", "junit_family=xunit1"],  # xunit1 keeps properties
        cwd=ROOT, check=False, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else done.stderr.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path,
                        help="an earlier run's JUnit XML report (default: run the rows)")
    parser.add_argument("--engine", type=Path, default=OUT_DIR / "engine.json",
                        help="the engine rows' outcomes (default: %(default)s)")
    parser.add_argument("--print", action="store_true", help="print, do not write")
    args = parser.parse_args(argv)
    report = args.junit
    if report is None:
        report = OUT_DIR / "trainer.xml"
        print(f"{TESTS}: {run_trainer_rows(report)}")
    engine = json.loads(args.engine.read_text()) if args.engine.is_file() else {}
    page = render(read_report(report), engine)
    if args.print:
        print(page, end="")
    else:
        DOCS_PATH.write_text(page)
        print(f"wrote {DOCS_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
