"""Engine rows of the model parity matrix: vLLM's CPU build against the model's own forward.

For every family of ``async_rl.models.families.ARCHITECTURES`` (a tiny random fp32
model from ``build_family_model``), vLLM scores fixed token sequences (prompt logprobs,
longer than the families' sliding window) and generates a few greedy tokens (logprobs
of the decode path, through its KV cache); transformers' eager fp32 forward of the same
tokens must give the same log-probs within ``TOLERANCE``: the tolerance
``assert_behaviour_logprobs`` in ``tests/integration/test_rollout.py`` holds vLLM's
behaviour logprobs to against transformers (abs 1e-4). Then a new version (every
weight perturbed, named as the trainer sends it: ``workers.trainer.engine_names``) is
loaded into the running engine as the "gloo" transport loads one
(``workers.weights.version_load``), and the sequences' log-probs must equal the
perturbed model's, within the same tolerance.

A row is ``exact`` when both hold. Families vLLM's CPU build cannot serve are listed in
``NOT_ON_CPU`` with the error it raises: their row asserts that vLLM really fails with
it (a family that starts working, or fails otherwise, fails its row) and records ``not
on CPU: <vLLM's error>``. Families a version cannot reach (``workers.rollout.engine.
update_refusal``) are refused at start without model.lora: their row asserts that the
refusal holds (the version really does not reach the engine, and ``async-rl train``
stops in one line) and records ``refused: <the line>``.

The test process builds the models and runs transformers; one child process (this
file run as a script) starts one engine per family in turn, in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a failure is vLLM's own exception, not a dead
engine process. Apart because the engines bind their process's threads and memory
policy, and vLLM's model modules patch some of transformers' classes (Olmo2's). The
rows' outcomes go to ``runs/model-matrix/engine.json`` (``{arch: "exact" | "refused:
..." | "not on CPU: <vLLM's error>"}``), which docs/models.md is generated from. About
75 s for all families on two busy cores. vLLM inspects each family's model class in
the child itself, not in a subprocess per family as it would (see ``_child``).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from async_rl.models.families import ARCHITECTURES, model_type
from buffers.common.config import ConfigError
from workers.rollout.engine import update_refusal

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
ENGINE_JSON = REPO / "runs" / "model-matrix" / "engine.json"
"""The rows' outcomes, read by the generator of docs/models.md."""
TOLERANCE = 1e-4
"""Largest |engine - transformers| log-prob of one token: test_rollout.py's
``assert_behaviour_logprobs`` (vLLM's behaviour logprobs against transformers, abs 1e-4)."""
MIN_RANGE = 100 * TOLERANCE
"""The reference log-probs of a row must spread over more than this (max - min): a row
whose model gave every token the same log-prob could not tell a wrong engine."""
NOT_ON_CPU = {
    "qwen3_next": "CPU GDN attention requires BF16",
    "qwen3_5": "No module named 'torchvision'",
    "qwen3_5_moe": "No module named 'torchvision'",
}
"""Families vLLM 0.32's CPU build cannot serve in fp32, and a part of the error it
raises. Qwen3-Next's gated delta-net layers run only in bf16 there; vLLM's Qwen3.5
module imports torchvision, which this CPU venv leaves out (the PyPI build does not
match the CPU torch)."""
SEQUENCES = tuple(tuple(3 + (37 * i + 11 * j) % 256 for j in range(n))
                  for i, n in enumerate((9, 17, 30)))
"""Byte tokens scored by prompt logprobs; 17 and 30 tokens outrun the sliding window."""
GREEDY_PROMPT = SEQUENCES[1]
GREEDY_TOKENS = 12
FAMILY_TIMEOUT_S = 240
"""A family whose engine neither starts nor fails within this is recorded as failing."""
CHILD_TIMEOUT_S = 1500


NOISE = 0.5
"""The new version: each weight plus seeded noise of this many times its own std."""


def verdict(row: dict[str, Any]) -> str:
    """A row's entry in engine.json."""
    if row["error"] is not None:
        return f"not on CPU: {row['error']}"
    if row["refusal"] is not None:
        return f"refused: {row['refusal']}"
    worst = max(row["max_abs_diff"], row["update_max_abs_diff"])
    if worst <= TOLERANCE:
        return "exact"
    return f"differs: max |log-prob difference| {worst:.3g} > {TOLERANCE:g}"


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """Every family's row: the models built and scored by transformers here, served by
    vLLM in one child process; engine.json written from them."""
    from async_rl.models.families import build_family_model

    work = tmp_path_factory.mktemp("engine-matrix")
    start = time.monotonic()
    updated = {}
    for arch in ARCHITECTURES:
        build_family_model(arch, work / arch)
        updated[arch] = new_version(work / arch, work / f"{arch}.update.safetensors")
    out = work / "served.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # apply_model's function, in process
           "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO),
                                                       os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, __file__, str(out), str(work), *ARCHITECTURES],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=CHILD_TIMEOUT_S, check=False)
    log = done.stdout.decode(errors="replace")
    assert done.returncode == 0 and out.is_file(), log[-6000:]
    served: dict[str, dict[str, Any]] = json.loads(out.read_text())
    assert list(served) == list(ARCHITECTURES), log[-6000:]
    found = {arch: compare(work / arch, outcome, updated[arch])
             for arch, outcome in served.items()}
    ENGINE_JSON.parent.mkdir(parents=True, exist_ok=True)
    ENGINE_JSON.write_text(json.dumps({arch: verdict(row) for arch, row in found.items()},
                                      indent=1) + "\n")
    log_rows = logging.getLogger(__name__)
    for arch, row in found.items():
        log_rows.info("%s: %s (max |difference| %s, after the update %s; the update moved "
                      "the model's own by %.3f)", arch, verdict(row), row["max_abs_diff"],
                      row["update_max_abs_diff"], row["update_moved"])
    log_rows.info("engine rows: %.0f s for %d families", time.monotonic() - start,
                  len(found))
    yield found


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_engine_logprobs_equal_the_models_own_or_vllm_refuses(
        arch: str, rows: dict[str, dict[str, Any]]) -> None:
    row = rows[arch]
    if arch in NOT_ON_CPU:
        assert row["error"] is not None, f"{arch}: vLLM's CPU build serves it now: " \
            f"max |difference| {row['max_abs_diff']}; take it out of NOT_ON_CPU"
        assert NOT_ON_CPU[arch] in row["error"], row["detail"]
        assert verdict(row) == f"not on CPU: {row['error']}"
        return
    assert row["error"] is None, row["detail"]
    # prompt logprobs of every sequence after its first token, and the greedy tokens
    assert row["compared"] == sum(len(s) - 1 for s in SEQUENCES) + GREEDY_TOKENS
    assert row["reference_range"] > MIN_RANGE, row
    assert row["max_abs_diff"] <= TOLERANCE, row
    # the new version moved the model's own log-probs far more than the tolerance
    assert row["update_moved"] > MIN_RANGE, row
    if row["refusal"] is not None:
        assert row["update_max_abs_diff"] > MIN_RANGE, \
            f"{arch}: a version reaches the engine now; take it out of update_refusal"
        from async_rl.run.inputs import check_engine_updates

        with pytest.raises(ConfigError, match=re.escape(row["refusal"])) as refused:
            check_engine_updates(str(row["model_dir"]))
        assert "\n" not in str(refused.value) and arch in str(refused.value)
        assert verdict(row) == f"refused: {row['refusal']}"
        return
    assert row["update_max_abs_diff"] <= TOLERANCE, row
    assert verdict(row) == "exact"


def reference_logprobs(model_dir: Path, sequences: list[list[int]],
                       model: Any = None) -> list[list[float]]:
    """Each sequence's log-probs of its tokens after the first, by transformers (eager,
    fp32, one sequence at a time: no padding): of ``model``, else of ``model_dir``'s."""
    import torch
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logprobs = model(ids).logits[0, :-1].float().log_softmax(-1)
            out.append(logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


def new_version(model_dir: Path, out: Path) -> dict[str, Any]:
    """Writes to ``out`` a new version of the model in ``model_dir`` (every weight
    perturbed, under the names the trainer sends: ``engine_weights``); returns the
    perturbed model's log-probs of ``SEQUENCES`` and how far they moved."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from workers.trainer.engine_names import engine_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    before = reference_logprobs(model_dir, list(map(list, SEQUENCES)), model)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            scale = param.std() if param.numel() > 1 else param.abs() + 1
            param.add_(torch.randn(param.shape, generator=noise) * scale * NOISE)
    save_file({name: t.contiguous() for name, t in engine_weights(
        model, model.named_parameters())}, str(out))
    after = reference_logprobs(model_dir, list(map(list, SEQUENCES)), model)
    moved = max(abs(a - b) for x, y in zip(before, after, strict=True)
                for a, b in zip(x, y, strict=True))
    return {"reference": after, "moved": moved}


def compare(model_dir: Path, served: dict[str, Any], updated: dict[str, Any]
            ) -> dict[str, Any]:
    """A family's row: what vLLM gave (``served``, from the child) against transformers,
    before and after the new version (``updated``: ``new_version``'s)."""
    row = {**served, "max_abs_diff": None, "compared": 0, "reference_range": 0.0,
           "model_dir": model_dir, "refusal": update_refusal(model_type(model_dir.name)),
           "update_moved": updated["moved"], "update_max_abs_diff": None}
    if served["error"] is not None:
        return row
    row["update_max_abs_diff"] = max(
        abs(a - b) for e, r in zip(served["updated_logprobs"], updated["reference"],
                                   strict=True) for a, b in zip(e, r, strict=True))
    generated = served["greedy_tokens"]
    reference = reference_logprobs(
        model_dir, [*map(list, SEQUENCES), [*GREEDY_PROMPT, *generated]])
    reference[-1] = reference[-1][-len(generated):]
    engine = [*served["prompt_logprobs"], served["greedy_logprobs"]]
    pairs = [(a, b) for e, r in zip(engine, reference, strict=True)
             for a, b in zip(e, r, strict=True)]
    expected = [b for _, b in pairs]
    row.update(compared=len(pairs), max_abs_diff=max(abs(a - b) for a, b in pairs),
               reference_range=max(expected) - min(expected))
    return row


# ---- the child process: one engine per family, in turn --------------------------------
# It never runs transformers' own classes: vLLM's model modules patch some of them.


def _error_line(err: BaseException, model_dir: Path) -> str:
    """One line: the innermost exception's first line; when vLLM's model registry could
    not inspect the model's class (it does so in a subprocess and only logs why), the
    error importing that class here, which is why."""
    inner = err
    while inner.__cause__ is not None:
        inner = inner.__cause__
    lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip()]
    message = next((ln for ln in lines if "Value error, " in ln), lines[0] if lines else "")
    message = message.split("Value error, ")[-1].split(" [type=")[0]  # pydantic's wrapping
    line = f"{type(inner).__name__}: {message}"
    if "failed to be inspected" in line:
        from vllm import ModelRegistry

        config = json.loads((model_dir / "config.json").read_text())
        for name in config.get("architectures") or ():
            try:
                ModelRegistry.models[name].load_model_cls()
            except Exception as cause:
                line = line.replace(" Please check the logs for more details.", "")
                return f"{line} ({type(cause).__name__}: {cause})"
    return line


def _prompt_logprobs(outputs: list[Any]) -> list[list[float]]:
    return [[entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], seq[1:],
                                                  strict=True)]
            for out, seq in zip(outputs, SEQUENCES, strict=True)]


def _serve(model_dir: Path, update: Path) -> dict[str, Any]:
    """A fresh engine on ``model_dir``: its prompt logprobs of ``SEQUENCES``, a greedy
    completion of ``GREEDY_PROMPT`` with its logprobs, and the prompt logprobs again
    after loading the version in ``update``; or the error it fails with."""
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from workers.weights.version_load import load_version

    llm = None
    try:
        llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True,
                  gpu_memory_utilization=0.1, max_model_len=128, seed=0)
        scored = llm.generate([{"prompt_token_ids": list(s)} for s in SEQUENCES],
                              SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
        greedy = llm.generate([{"prompt_token_ids": list(GREEDY_PROMPT)}],
                              SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0,
                                             logprobs=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
        staged = list(load_file(str(update)).items())
        config = llm.llm_engine.model_config
        llm.apply_model(lambda model: load_version(model, config, staged))
        rescored = llm.generate([{"prompt_token_ids": list(s)} for s in SEQUENCES],
                                SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)
    except Exception as err:
        return {"error": _error_line(err, model_dir),
                "detail": traceback.format_exc()[-4000:]}
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        del llm
    tokens = list(greedy.token_ids)
    return {"error": None, "detail": "", "prompt_logprobs": _prompt_logprobs(scored),
            "updated_logprobs": _prompt_logprobs(rescored), "greedy_tokens": tokens,
            "greedy_logprobs": [entry[t].logprob for entry, t in zip(
                greedy.logprobs, tokens, strict=True)]}


def _timed_out(signum: int, frame: object) -> None:
    raise TimeoutError(f"no engine within {FAMILY_TIMEOUT_S} s")


def _child(out: Path, models: Path, archs: list[str]) -> None:
    """Writes ``{arch: what vLLM gave}`` for ``archs`` to ``out``, after every family."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )
    from vllm.model_executor.models import registry

    # vLLM inspects each model class in a subprocess of its own, to keep CUDA out of
    # the caller: one vLLM import, about 20 s a family on a cold model-info cache (a
    # fresh machine's). This process is CPU-only: there is no CUDA to keep out.
    registry._run_in_subprocess = lambda fn: fn()
    signal.signal(signal.SIGALRM, _timed_out)
    found: dict[str, dict[str, Any]] = {}
    for arch in archs:
        start = time.monotonic()
        signal.alarm(FAMILY_TIMEOUT_S)
        try:
            found[arch] = _serve(models / arch, models / f"{arch}.update.safetensors")
        finally:
            signal.alarm(0)
            destroy_model_parallel()
            destroy_distributed_environment()
            gc.collect()
        found[arch]["seconds"] = round(time.monotonic() - start, 1)
        print(f"ENGINE ROW {arch}: {found[arch]['error'] or 'served'} "
              f"({found[arch]['seconds']} s)", flush=True)
        out.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":  # the child: served.json, the models' folder, the families
    _child(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
