"""TrainerShard: one data-parallel shard of the policy, trained with the GRPO loss.

Owns: the torch model (a DDP replica, or with ``trainer.backend = "fsdp2"`` its FSDP2
shard: ``workers.trainer.fsdp`` builds it and gathers it whole), its optimizer, the
process group (gloo on CPU, nccl on CUDA), executing a ShardBatch update by update
(``trainer.epochs`` passes, one optimizer step per update, skipped when its gradient norm
is not finite) and micro-batch by micro-batch (each one a padding-free packed row,
``workers.trainer.packing``, laid out once a step; the losses and their normalisers are
``workers.trainer.ppo_update``'s), with no host read of a device value inside the
micro-batch loop (the statistics are read once a step, the gradient norm once an update
for the non-finite skip; phase times from ``workers.trainer.phase_clock``), on the shard
that is the source of weight broadcasts, the calls that snapshot and send its weights
(``workers.weights.sender`` does both), and the entry points that write and read its
saves and its part of a checkpoint (``workers.trainer.shard_saves`` does both). With a
reference or a critic (``workers.trainer.shard_roles``) a step's data is laid out by the PPO
dataflow's stages first and its policy update takes it from there. Knows nothing about
Ray (``workers.actors`` wraps this class for Ray and resolves the batch's group
references), queues, versions or how the plan was made.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from buffers.common.records import GroupTokens
from buffers.common.reports import UsageReading
from buffers.common.train_records import LossStats, ShardBatch, ShardStepResult
from workers.common.spans import UNRESOLVED, Span, SpanRecorder
from workers.trainer.fsdp import clip_grad_norm
from workers.trainer.lora import LoraPolicy, adapter_state
from workers.trainer.loss import Normaliser, PendingStats, read_stats
from workers.trainer.phase_clock import PhaseClock
from workers.trainer.policy_model import DTYPES, load_policy
from workers.trainer.ppo_update import Prepared, StepLoss
from workers.trainer.process import device_label, join_process_group, start_process
from workers.trainer.publisher import PolicyPublisher
from workers.trainer.shard_roles import StepRoles, build_roles
from workers.trainer.shard_saves import ShardSaves
from workers.trainer.spec import TrainerSpec
from workers.weights.config import UpdateMode

if TYPE_CHECKING:
    from workers.weights.broadcast import Delivery
    from workers.weights.sender import WeightSender

log = logging.getLogger(__name__)


class TrainerShard:
    """The policy on one device, a replica (ddp) or a shard (fsdp2); ``world_size`` of
    them form one data-parallel group."""

    def __init__(self, spec: TrainerSpec) -> None:
        """Cheap: records ``spec``; ``setup()`` joins the group and loads the model. The
        reference and the critic of ``spec`` live beside the policy on this shard's
        device (``workers.trainer.shard_roles``)."""
        self.spec = spec
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.model_config = spec.model
        self.config = spec.trainer
        self.temperature = spec.sampling.temperature
        """Rollout's sampling temperature: behaviour logprobs are of logits / temperature."""
        self.max_new_tokens = spec.sampling.max_new_tokens
        """Rollout's completion cap: loss_agg seq_mean_token_sum_norm divides by it."""
        self.rollout_dtype = spec.sampling.dtype or spec.model.dtype
        """The engines' dtype (rollout.dtype): published weights are cast to it."""
        self.lora: LoraPolicy | None = None
        """With model.lora on (from setup): what versions, checkpoints and saves hold."""
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.publisher = PolicyPublisher(
            rank=spec.rank, weights=spec.weights, address=spec.master_addr,
            device=self.device, dtype=DTYPES[self.rollout_dtype],
            sharded=spec.trainer.backend == "fsdp2")
        label = device_label(self.device, spec.cpu_ids)
        self.spans = SpanRecorder(worker=f"trainer-{spec.rank}", role="trainer",
                                  rank=spec.rank, device=label, enabled=spec.record_spans)
        """Phase spans on the host's clock: on CUDA the kernels run behind them (the
        step's phase times are the device's, from ``PhaseClock``'s events)."""
        self.compiled_layers = 0
        """Decoder layers ``trainer.compile`` compiled; the first step logs its time."""
        self.roles: StepRoles | None = None
        """The reference and the critic beside the policy, when the run has either."""
        self.critic_spans = SpanRecorder(
            worker=f"critic-{spec.rank}", role="critic", rank=spec.rank, device=label,
            enabled=spec.record_spans and spec.critic is not None)

    def setup(self) -> int:
        """Joins the process group, loads the model and builds the optimizer; returns pid."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_config.path)  # for the saves

        self.usage_meter = start_process(self.device, self.spec.cpu_ids)
        torch.manual_seed(self.spec.seed)
        sharded = self.config.backend == "fsdp2"
        if self.world_size > 1 or sharded:  # FSDP2's device mesh needs a group, even of one
            join_process_group(self.device, master_addr=self.spec.master_addr,
                               master_port=self.spec.master_port, rank=self.rank,
                               world_size=self.world_size)
        dtype = DTYPES[self.model_config.dtype]
        module, self.lora, self.compiled_layers = load_policy(
            self.model_config, self.config, self.device, self.spec.seed)
        self.module = module
        """The model itself (with fsdp2, sharded: every forward is a collective)."""
        self.model: torch.nn.Module = (
            DistributedDataParallel(module) if self.world_size > 1 and not sharded
            else module
        )
        self.optimizer = torch.optim.AdamW(
            # All of them, or with LoRA the adapters only (the rest is frozen).
            [p for p in module.parameters() if p.requires_grad], lr=self.config.lr,
            weight_decay=self.config.weight_decay,
            # One fused kernel over every tensor: on CPU 3-5x faster than the default
            # per-tensor loop (bench/trainer/packing.py measures both).
            fused=self.device.type in ("cpu", "cuda"),
        )
        self.losses = StepLoss(config=self.config, model=self.model, module=module,
                               device=self.device, world_size=self.world_size,
                               packed=self.config.packed, temperature=self.temperature,
                               max_response_tokens=self.max_new_tokens,
                               sharded=sharded)
        if self.spec.reference_path or self.spec.critic is not None or self.spec.own_roles:
            self.roles = build_roles(
                trainer=self.config, losses=self.losses, device=self.device, dtype=dtype,
                world_size=self.world_size, rank=self.rank, temperature=self.temperature,
                reference_path=self.spec.reference_path, critic=self.spec.critic,
                spans=(self.spans, self.critic_spans), own_roles=self.spec.own_roles)
        self.saves = ShardSaves(
            rank=self.rank, backend=self.config.backend, module=module,
            optimizer=self.optimizer, tokenizer=tokenizer, lora=self.lora,
            critic=self.roles.critic if self.roles is not None else None,
            save_merged=self.spec.save_merged)
        return os.getpid()

    def train_step(self, batch: ShardBatch,
                   tokens: Sequence[GroupTokens] | None) -> ShardStepResult:
        """One step: ``trainer.epochs`` passes over the batch's updates, each update one
        optimizer step over its micro-batches (``workers.trainer.ppo_update`` makes the losses).

        ``tokens``: ``batch.groups`` resolved, in order; None when this shard could not
        fetch them (their rollout worker died). Then no shard trains: every shard
        returns a result with ``samples_lost`` set and the weights unchanged.
        """
        # The PPO dataflow laid the step out already (and added its advantages).
        ppo = self.roles.current(batch.step) if self.roles is not None else None
        # Without its groups a shard still sends its (zero) counts in the all-reduce.
        sequences = (ppo.sequences if ppo is not None
                     else batch.sequences(tokens) if tokens is not None
                     else ((),) * len(batch.micro_batches))
        updates = batch.per_update(sequences)
        self.spans.switch("barrier", batch.step - 1)  # the count all-reduce waits for all shards
        norms, lost = self.losses.agree(updates, ppo.lost if ppo is not None
                                        else tokens is None)
        if lost:
            self.spans.switch(UNRESOLVED, batch.step - 1)
            return ShardStepResult(rank=self.rank, step=batch.step, loss=LossStats(),
                                   grad_norm=0.0, forward_s=0.0, backward_s=0.0,
                                   optimizer_s=0.0, barrier_s=0.0, samples_lost=True)
        began = time.perf_counter()
        self.critic_spans.switch("policy")  # a co-located critic waits on the device
        clock = PhaseClock(self.device)
        self.spans.switch("forward")
        clock.start("forward")
        # Once: the proximal pass and every epoch.
        prepared = ppo.prepared if ppo is not None else self.losses.prepare(sequences)
        references = batch.per_update(ppo.reference if ppo is not None and ppo.reference
                                      else [None] * len(prepared))
        # The proximal policy is the one this step starts from; with a single update and
        # no dropout it is the current policy itself, so no extra forward pass is needed
        # (nor in the plain form, tis_cap = 0, which has no proximal policy). The PPO
        # dataflow may have computed it already (the KL in the reward's policy).
        start: list[torch.Tensor | None] = [None] * len(prepared)
        if self.losses.needs_proximal(len(updates)):
            start = (ppo.policy if ppo is not None and ppo.policy
                     else self.losses.proximal(prepared))
        proximal = batch.per_update(start)
        parts: list[PendingStats] = []
        norms_seen: list[float] = []
        positions = 0
        for epoch in range(self.config.epochs):
            for micro_batches, norm, prox, ref in zip(batch.per_update(prepared), norms,
                                                      proximal, references, strict=True):
                computed, grad_norm = self._update(micro_batches, norm, prox, ref, parts,
                                                   clock)
                positions += computed if epoch == 0 else 0
                norms_seen.append(grad_norm)
                if not math.isfinite(grad_norm):
                    break  # the rest of the step would build on a diverged update
            if not math.isfinite(norms_seen[-1]):
                break
        clock.start(None)  # the phases end before the read below waits for the device
        loss = read_stats(parts)  # the step's one read of its statistics
        kl_sum, kl_max = self.losses.read_kl()
        if self.roles is not None:
            self.roles.policy_done()
        times = clock.totals()
        if self.compiled_layers:
            log.info("trainer shard %d: step %d took %.1f s (%d compiled decoder layers; "
                     "the first step includes compiling them)", self.rank, batch.step,
                     time.perf_counter() - began, self.compiled_layers)
            self.compiled_layers = 0  # logged once
        if self.spec.writes_checkpoints:
            self.saves.prepare_checkpoint()
        self.spans.switch(UNRESOLVED, batch.step)
        self.critic_spans.switch(UNRESOLVED)
        return ShardStepResult(
            rank=self.rank,
            step=batch.step,
            loss=loss,
            # The largest, a non-finite one before any other.
            grad_norm=max(norms_seen, default=0.0,
                          key=lambda n: n if math.isfinite(n) else math.inf),
            forward_s=times.get("forward", 0.0),
            backward_s=times.get("backward", 0.0),
            optimizer_s=times.get("optimizer", 0.0),
            barrier_s=times.get("barrier", 0.0),
            # Nothing was trained only if the first update was skipped; after a later
            # one the step stops, keeping the updates made before it.
            nonfinite=not math.isfinite(norms_seen[0]),
            input_tokens=sum(len(s.prompt_token_ids) + len(s.completion_token_ids)
                             for mb in sequences for s in mb),
            computed_positions=positions,
            kl_sum=kl_sum,
            kl_max=kl_max,
        )

    def _update(self, micro_batches: Sequence[Prepared], norm: Normaliser,
                proximal: Sequence[torch.Tensor | None],
                references: Sequence[torch.Tensor | None], parts: list[PendingStats],
                clock: PhaseClock) -> tuple[int, float]:
        """One optimizer update; appends each micro-batch's statistics to ``parts`` and
        marks its phases on ``clock``. Returns (positions computed, gradient norm): the
        norm's read is the update's one wait for the device."""
        self.optimizer.zero_grad(set_to_none=True)
        positions = 0
        last = len(micro_batches) - 1
        for index, (micro_batch, prox, ref) in enumerate(zip(micro_batches, proximal,
                                                             references, strict=True)):
            self.spans.switch("forward")
            clock.start("forward")
            loss, stats, computed = self.losses.micro_batch(micro_batch, norm, prox, ref)
            positions += computed
            # DDP averages gradients over shards; the loss is already a share of the
            # global normaliser, so scale back up to make the all-reduce a plain sum.
            loss = loss * self.world_size
            if index == last and self.world_size > 1:
                # Time spent here is waiting on slower shards, not communication.
                self.spans.switch("barrier")
                clock.start("barrier")
                self._wait_for_shards()
            self.spans.switch("backward")
            clock.start("backward")
            if index != last and isinstance(self.model, DistributedDataParallel):
                with self.model.no_sync():
                    torch.autograd.backward(loss)
            else:
                if self.config.backend == "fsdp2":  # reduce-scatter at the last only
                    self.module.set_requires_gradient_sync(  # type: ignore[operator]
                        index == last)
                torch.autograd.backward(loss)
            if stats is not None:
                parts.append(stats)
        self.spans.switch("optimizer")
        clock.start("optimizer")
        grad_norm = clip_grad_norm(self.module.parameters(), self.config.max_grad_norm)
        # Every shard sees the same all-reduced gradient, so they all agree to skip.
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return positions, grad_norm

    def _wait_for_shards(self) -> None:
        """Waits for every shard to reach its update's last backward, so that the
        phases tell waiting on slower shards (``barrier``) from the gradient all-reduce
        (``backward``). Not needed for correctness: that all-reduce synchronises the
        shards anyway. On the CPU the host waits (gloo). On an accelerator only its
        stream does: a one-element all-reduce the stream waits on, while the host goes
        on queueing the backward (NCCL's ``barrier`` would block the host until every
        shard arrived: a host sync at every update)."""
        if self.device.type == "cpu":
            dist.barrier()
        else:
            dist.all_reduce(torch.zeros(1, device=self.device))

    def stages(self) -> StepRoles:
        """The PPO dataflow's stages on this shard (the actor's entry points call them)."""
        if self.roles is None:
            raise RuntimeError(f"trainer shard {self.rank}: no reference or critic here")
        return self.roles

    def mean_cores(self) -> float:
        """Threads this shard computes with: the cores the CPU-time check divides by."""
        return float(torch.get_num_threads())

    def drain_spans(self) -> list[Span]:
        """Closed spans since the last call (the current one is closed at now first),
        the co-located critic's among them."""
        return self.spans.flush() + self.critic_spans.flush()

    def usage(self) -> UsageReading:
        """CPU time (and on CUDA, NVML utilisation) for the span cross-check."""
        return self.usage_meter.read()

    def clock(self) -> float:
        """This process's wall clock, for the controller to align span times across nodes."""
        return time.time()

    # ---- weight broadcasts (the source shard only) -------------------------------------

    def connect_rollout(self, rank: int, actor: Any) -> None:
        """Makes rollout worker ``rank`` a member of the weight-broadcast group."""
        self.publisher.connect(rank, actor)

    @property
    def sender(self) -> WeightSender | None:
        """Shard 0's end of weight broadcasts, from the first ``connect_rollout``."""
        return self.publisher.sender

    def snapshot_weights(self, version: int) -> int:
        """Copies the weights as ``version`` for the sends to come (with LoRA the
        adapters only); returns their bytes (0 on an fsdp2 shard that only takes part in
        the gather). Called in order with training calls, so it captures exactly
        ``version``; the sends then run beside the next steps."""
        adapters = adapter_state(self.saves.whole()) if self.lora is not None else None
        return self.publisher.snapshot(version, self.module, adapters)

    def send_weights(self, version: int, ranks: Sequence[int], mode: UpdateMode | None = None
                     ) -> Delivery:
        """Makes the snapshot of ``version`` the policy of rollout workers ``ranks``."""
        return self.publisher.send(version, ranks, mode)

    def release_weights(self, version: int) -> None:
        """Frees the snapshot of ``version`` (every send of it is done)."""
        self.publisher.release(version)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's weights (what the evaluator loads). Called in order with training
        calls, so they are exactly the version just trained; the actor's return value is
        copied into the object store before its next call runs, so no clone is needed.
        With fsdp2 every shard calls it; the others' are empty."""
        return self.saves.policy()

    # ---- saves and checkpoints (workers.trainer.shard_saves) ---------------------------

    def save(self, out_dir: str) -> bool:
        """``ShardSaves.save``: the final model; False where this shard wrote nothing."""
        return self.saves.save(out_dir)

    def save_policy(self, out_dir: str) -> None:
        """``ShardSaves.save_policy``: a folder an engine can start from."""
        self.saves.save_policy(out_dir)

    def save_checkpoint(self, out_dir: str) -> None:
        """``ShardSaves.save_checkpoint``: this shard's part, written in the background."""
        self.saves.save_checkpoint(out_dir)

    def checkpoint_written(self) -> None:
        """Returns once the last ``save_checkpoint`` is on disk; raises its error."""
        self.saves.checkpoint_written()

    def load_training_state(self, checkpoint_dir: str) -> None:
        """``ShardSaves.load_training_state``: what ``save_checkpoint`` wrote."""
        self.saves.load_training_state(checkpoint_dir)

    def shutdown(self) -> None:
        self.saves.close()
        if self.lora is not None:
            self.lora.close()
        self.publisher.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
