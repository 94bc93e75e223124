"""GPU check: the trainer-side CUDA paths that no GPU had run, on one GPU, a row at a time.

Runs with only torch, transformers and the wheels ``scripts/gpu-check.sh`` carries
(msgspec, nvidia-ml-py, psutil): nothing here imports ray or vllm (checked before
anything runs). Without CUDA it prints one line and exits 0. On CUDA, on a randomly
initialised Qwen2.5-0.5B-shaped model (``async_rl.models.real_size``), each row is its
own guarded check (one that raises is a FAILED row, the others still run), printed as a
Markdown table row and flushed as soon as it is made, and appended to
``OUT/results.md`` (``--out``, default ``runs/gpu-check``), so a run cut short keeps
every row it made:

- the attention kernels (``workers.trainer.attention``): the one-call varlen kernel against
  the per-sequence loop on 2.5k and 16k tokens of Qwen2.5-0.5B's heads in bf16
  (outputs, q/k/v gradients, forward + backward time; the row names the kernel that
  runs for grouped-query heads), and on 2.5k as a sliding-window layer of ``WINDOW``
  tokens (the window handed to the kernel against the loop's mask);
- packed against padded logprobs on a long-tail batch, float32 (TF32 off: the row
  checks the packing) and bf16 compute; the padded reference is never compiled;
- ``TrainerShard`` steps (``bench/trainer/trainer_step.py`` builds them), each with ms, tokens/s,
  MFU (6 N per token plus causal attention, against the GPU's dense bf16 peak), host
  syncs per step (``torch.cuda.set_sync_debug_mode``), peak memory and the fraction of
  the step the GPU is busy (profiler kernel time / wall): (a) today's path and (b) the
  new one on the check batch (48 long-tail sequences, 2 micro-batches), (b') the new one
  in float32 compute (TF32), (c) 4 x 16k-token micro-batches eager, (d) the same
  compiled (``trainer.compile``), (e) the same with Qwen's 151,936-token vocabulary,
  today's path and the new one compiled;
- NVML's view of each visible GPU, found by the UUID CUDA reports
  (``workers.common.usage.cuda_uuid``), beside what an index lookup would have sampled;
- FSDP2 at world size 1: ``fully_shard`` per decoder layer and the root with a pinned
  ``CPUOffloadPolicy`` and bf16 ``MixedPrecisionPolicy``, two AdamW steps;
- FSDP2 offload's gradient clip at world size 1 in the group trainer.offload makes
  ("cpu:gloo,cuda:nccl", ``process_group_backend``), beside the same clip over a group
  of NCCL alone, which has no backend for the CPU gradients.

The rows are ``bench/trainer/gpu_rows.py``'s, at its ``Scale`` ``GPU`` (the sizes above);
tests/unit/test_gpu_check.py runs every row on the CPU at a tiny scale, with the CUDA
calls stubbed.

    scripts/gpu-check.sh [--out DIR]   (or: python -m bench.trainer.gpu_check)
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from bench.trainer.gpu_rows import (
    Row,
    Setup,
    attention_row,
    fsdp2_check,
    logprob_row,
    nvml_check,
    offload_clip_check,
    step_row,
)

FORBIDDEN = ("ray", "vllm")
"""Not on the GPU machine: importing either would fail there."""
FAILED = ("FAILED", "MISMATCH", "NON-FINITE")
"""Results that make the check exit 1."""
Check = tuple[str, Callable[[], list[Row]]]
"""(name, the rows it makes): one guarded unit."""
WINDOW = 128
"""The sliding window of the windowed attention row: gpt-oss's."""


def checks(setup: Setup) -> list[Check]:
    """Every row's check, in the table's order."""
    def one(make: Callable[[], Row]) -> Callable[[], list[Row]]:
        return lambda: [make()]

    def step(label: str, way: str, dtype: str, batch: str, compiled: bool) -> Check:
        return label, one(functools.partial(step_row, label, setup, way, dtype, batch,
                                             compiled))

    backend = "nccl" if setup.device.type == "cuda" else "gloo"
    return [
        *[(f"varlen attention = loop ({n} tokens)", one(functools.partial(
            attention_row, n, setup))) for n in setup.scale.attention_tokens],
        (f"varlen attention = loop ({setup.scale.attention_tokens[0]} tokens, window "
         f"{WINDOW})", one(functools.partial(attention_row, setup.scale.attention_tokens[0],
                                             setup, WINDOW))),
        ("packed = padded logprobs (float32)", one(lambda: logprob_row(setup, "float32"))),
        # TF32 matmuls, the attention loop: bf16 is the GPU setup
        step("(b') new path, float32 compute", "new", "float32", "check", False),
        ("packed = padded logprobs (bfloat16)", one(lambda: logprob_row(setup, "bfloat16"))),
        step("(a) today's path, check batch", "today", "bfloat16", "check", False),
        step("(b) new path, check batch", "new", "bfloat16", "check", False),
        step("(c) 4 x 16k eager", "new", "bfloat16", "long", False),
        step("(d) 4 x 16k compiled", "new", "bfloat16", "long", True),
        step("(e) 151,936 vocab, today's path", "today", "bfloat16", "wide", False),
        step("(e) 151,936 vocab, new path compiled", "new", "bfloat16", "wide", True),
        ("NVML by UUID", nvml_check),
        ("FSDP2 + pinned CPUOffloadPolicy", one(lambda: fsdp2_check(setup))),
        ("FSDP2 offload clip", lambda: offload_clip_check(
            setup.device, accelerator_backend=backend, port=setup.port + 1)),
    ]


class Report:
    """The table as it is made: each row printed (flushed) and appended to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[Row] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            out.write(f"\n{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n\n")
        self._line(("check", "result", "figures"))
        self._line(("---", "---", "---"))

    def _line(self, row: Row) -> None:
        line = "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"
        print(line, flush=True)
        with self.path.open("a") as out:
            out.write(line + "\n")

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self._line(row)

    def run(self, name: str, check: Callable[[], list[Row]]) -> None:
        """``check``'s rows, or one row saying how it failed; the next check runs
        either way."""
        try:
            rows = check()
        except Exception as err:  # reported in the table, not raised: one bad path is a row
            rows = [(name, "FAILED", f"{type(err).__name__}: {str(err).splitlines()[0][:150]}"
                     if str(err) else type(err).__name__)]
        finally:
            torch.cuda.empty_cache()
        for row in rows:
            self.add(row)

    @property
    def ok(self) -> bool:
        return all(r[1] not in FAILED for r in self.rows)


def run_all(setup: Setup, report: Report) -> None:
    """Every check, each row reported as it is made."""
    report.run("device", lambda: [(
        "device", torch.cuda.get_device_name(), f"torch {torch.__version__}, CUDA "
        f"{torch.version.cuda}, msgspec {msgspec.__version__}")])
    began = time.perf_counter()
    for name, check in checks(setup):
        report.run(name, check)
    report.add(("total", "", f"{time.perf_counter() - began:.0f} s"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"),
                        help="folder of results.md, to which every row is appended")
    args = parser.parse_args(argv)
    leaked = [m for m in FORBIDDEN if m in sys.modules]
    if leaked:
        print(f"gpu check error: importing the trainer pulled in {', '.join(leaked)}")
        return 1
    if not torch.cuda.is_available():
        print(f"gpu check skipped: no CUDA device (torch {torch.__version__}; imports "
              f"checked, no {' or '.join(FORBIDDEN)})")
        return 0
    report = Report(args.out / "results.md")
    with tempfile.TemporaryDirectory(prefix="async-rl-gpu-check-") as root:
        run_all(Setup(Path(root), torch.device("cuda")), report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
