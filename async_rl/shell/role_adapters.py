"""The shell's adapters of the reference's and the critic's workers of their own.

Owns: ``RayReference`` (a ``ReferenceClient``) and ``RayCritic`` (a ``CriticClient``)
over ``workers.actors.ReferenceActor`` / ``CriticActor`` handles, called the one way
every adapter calls (``async_rl.shell.adapters``), with trainer.step_timeout_s as a
stage's deadline and Ray's errors as ``RoleFailed``; a critic update started and
awaited later (``RayPendingUpdate``: its reference, so it runs while the policy's update
does), and the outputs as references the driver never fetches (``RayRoleOutput``).
``adapt_own_roles`` makes the started actors an ``OwnRoles``. Knows nothing about the
run's logic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from async_rl.config import Config
from async_rl.control.failures import RoleFailed
from async_rl.control.protocols import OwnRoles, RoleOutput
from async_rl.shell.adapters import RayRoleOutput, WorkerAdapter
from async_rl.shell.launch import StartedWorkers
from buffers.common.reports import CriticStepResult
from buffers.common.train_records import ShardBatch
from workers.common.errors import first_line


def _outputs(refs: Sequence[ray.ObjectRef[Any]]) -> list[RoleOutput]:
    return [RayRoleOutput(ref) for ref in refs]


class RayOwnRole(WorkerAdapter):
    """What both roles' adapters share: their failures, a stage's deadline."""

    def _failed(self, err: ray.exceptions.RayError, what: str) -> Exception:
        cause = getattr(err, "cause", None)
        reason = first_line(cause) if cause is not None else type(err).__name__
        return RoleFailed(self.name, f"{what}: {reason}",
                          dead=isinstance(err, ray.exceptions.RayActorError))

    def _stage(self, step: int, method: str) -> dict[str, Any]:
        """The keywords of ``_call`` / ``_result`` for a stage of ``step``."""
        def stuck(waited: str) -> Exception:
            return RoleFailed(self.name, f"no answer to {method} of step {step} {waited}",
                              dead=True, timed_out=True)

        return {"seconds": self.config.trainer.step_timeout_s,
                "key": "trainer.step_timeout_s", "what": f"{method} of step {step}",
                "on_timeout": stuck}

    async def mean_cores(self) -> float:
        cores: float = await self._call("mean_cores")
        return cores

    async def prepare_step(self, batches: Sequence[ShardBatch]) -> bool:
        step = batches[0].step
        lost: bool = await self._call("prepare_step_by_ref", list(batches),
                                      **self._stage(step, "prepare_step_by_ref"))
        return lost


class RayReference(RayOwnRole):
    """A ``ReferenceClient`` over a ``workers.actors.ReferenceActor`` handle."""

    async def reference_logprobs(self, step: int) -> list[RoleOutput]:
        refs = await self._call("reference_logprobs_refs", step,
                                **self._stage(step, "reference_logprobs_refs"))
        return _outputs(refs)


@dataclass(frozen=True)
class RayPendingUpdate:
    """A ``PendingCriticUpdate``: the update's reference and how to wait for it."""

    critic: RayCritic
    step: int
    pending: ray.ObjectRef[CriticStepResult]

    async def result(self) -> CriticStepResult:
        result: CriticStepResult = await self.critic._result(
            self.pending, "update", **self.critic._stage(self.step, "update"))
        return result


class RayCritic(RayOwnRole):
    """A ``CriticClient`` over a ``workers.actors.CriticActor`` handle."""

    async def critic_values(self, step: int) -> None:
        await self._call("values", step, **self._stage(step, "values"))

    async def advantages(self, step: int, reference: Sequence[RoleOutput],
                         policy: Sequence[RoleOutput]) -> list[RoleOutput]:
        # References as arguments: Ray hands the critic the tensors themselves (the
        # reference's, then the policy's: as many of each).
        outputs = [*reference, *policy]
        assert len(reference) == len(policy)
        assert all(isinstance(out, RayRoleOutput) for out in outputs)
        refs = [out.ref for out in outputs]  # type: ignore[attr-defined]
        found = await self._call("advantages_refs", step, *refs,
                                 **self._stage(step, "advantages_refs"))
        return _outputs(found)

    def start_update(self, step: int) -> RayPendingUpdate:
        return RayPendingUpdate(self, step, self.handle.update.remote(step))

    async def save_checkpoint(self, out_dir: str) -> None:
        await self._call("save", out_dir, seconds=self.config.trainer.step_timeout_s,
                         key="trainer.step_timeout_s")


def adapt_own_roles(started: StartedWorkers, config: Config) -> OwnRoles:
    """The started workers of the roles placed on their own, as the protocols (the
    trainer shards that take their outputs are added by ``adapted_workers.adapt``)."""
    return OwnRoles(
        reference=(RayReference("reference-0", started.reference, config)
                   if started.reference is not None else None),
        critics=[RayCritic(f"critic-{rank}", handle, config)
                 for rank, handle in enumerate(started.critics)],
        reference_to_critic=config.trainer.kl_in_reward and started.reference is not None)
