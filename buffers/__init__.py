"""Data plane: the vocabulary every layer speaks (``buffers.common``), the replay queue and
its admission gate (``buffers.queue``), and a step's plan: advantages, batching and
balancing (``buffers.plan``).

Pure Python + anyio + msgspec."""

from buffers.plan.balance import ShardPlan, StepPlan, pack, plan_step, sequence_costs
from buffers.plan.partition import partition
from buffers.queue.drop_accounting import DropHandler
from buffers.queue.errors import (
    GateShutDown,
    NotEnoughGroups,
    QueueClosed,
    QueueFull,
    QueueTooSmall,
    SequenceTooLong,
    WouldBlock,
)
from buffers.queue.queue_records import (
    DROP_STALE,
    BucketStatistics,
    Dropped,
    QueueItem,
    ReplayQueueSnapshot,
    ReplayQueueStatistics,
    TakenGroups,
    WaitStatistics,
)
from buffers.queue.replay_queue import ReplayQueue
from buffers.queue.staleness import AdmissionGate, GateSnapshot, GateStatistics

__all__ = [
    "DROP_STALE",
    "AdmissionGate",
    "BucketStatistics",
    "DropHandler",
    "Dropped",
    "GateShutDown",
    "GateSnapshot",
    "GateStatistics",
    "NotEnoughGroups",
    "QueueClosed",
    "QueueFull",
    "QueueItem",
    "QueueTooSmall",
    "ReplayQueue",
    "ReplayQueueSnapshot",
    "ReplayQueueStatistics",
    "SequenceTooLong",
    "ShardPlan",
    "StepPlan",
    "TakenGroups",
    "WaitStatistics",
    "WouldBlock",
    "pack",
    "partition",
    "plan_step",
    "sequence_costs",
]
