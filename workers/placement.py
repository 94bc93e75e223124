"""Placement: where the layout's workers run on a Ray cluster.

Owns: the node a placement group's bundle landed on (``bundle_node``), and the Ray
placement groups of the two roles (and of the reference's and critic's workers of their
own, ``own_roles_placement_group``; of the rollout engines ``[autopilot]`` may add,
``lendable_placement_group``), either disaggregated (the default: rollout and
trainer on their own devices) or co-located (both roles share one STRICT_PACK group),
and refusing, in one line, a layout the cluster cannot hold: too few GPUs for the
layout (``check_gpus``, before any group is asked for) or a group that is still
unplaced at its deadline (``role_placement_groups``). The layout itself (who owns which
cores) is ``workers.layout``'s. Knows nothing about what workers do.
"""

from __future__ import annotations

from collections.abc import Callable

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from buffers.common.config import ConfigError
from workers.layout import Layout, Role


def gpus_per_worker(cluster_gpus: float, colocated: bool) -> float:
    """GPUs each actor asks for: one per worker when the cluster has GPUs (the CUDA
    path), half when co-located (rollout worker i and trainer shard i share GPU i)."""
    if not cluster_gpus:
        return 0.0
    return 0.5 if colocated else 1.0


def check_gpus(layout: Layout, cluster_gpus: float, own_roles: int = 0) -> None:
    """Refuses a layout that needs more GPUs than the cluster has (none: the CPU path).

    Disaggregated, every rollout worker and every trainer shard needs a GPU of its own;
    co-located, pair i shares GPU i; each worker of a role placed on its own
    (``own_roles`` of them: reference.placement, critic.placement) needs one more.
    Without this, Ray would wait forever for bundles no
    node can hold (one GPU and the default split layout is the common case).
    """
    if not cluster_gpus:
        return
    pairs = max(len(layout.rollout), len(layout.trainer))
    needed = own_roles + (pairs if layout.colocated
                          else len(layout.rollout) + len(layout.trainer))
    if needed <= cluster_gpus:
        return
    workers = (f"{len(layout.rollout)} rollout worker(s) and {len(layout.trainer)} trainer "
               f"shard(s)" + (f" and {own_roles} reference/critic worker(s) of their own"
                              if own_roles else ""))
    if layout.colocated:
        raise ConfigError(f"config error: run.colocate = true: {workers} need {needed} GPU(s) "
                          f"(pair i shares GPU i), and the cluster has {cluster_gpus:g}")
    hint = ("; set run.colocate = true (rollout worker i and trainer shard i share GPU i)"
            if pairs + own_roles <= cluster_gpus else "")
    raise ConfigError(f"config error: run.colocate = false: {workers} need {needed} GPUs "
                      f"(one each), and the cluster has {cluster_gpus:g}{hint}")


def role_bundles(layout: Layout, cpus_per_rollout: int, cpus_per_trainer: int,
                 gpus: float = 0.0) -> dict[Role, list[dict[str, float]]]:
    """The resource bundles of each role's placement group (``gpus`` per actor).

    Co-located, both roles share one list: bundle i holds rollout worker i and trainer
    shard i side by side, with both their CPUs and GPU shares.
    """

    def bundles(count: int, cpus: int, per_bundle: int) -> list[dict[str, float]]:
        bundle: dict[str, float] = {"CPU": float(cpus)}
        if gpus:
            bundle["GPU"] = gpus * per_bundle
        return [dict(bundle) for _ in range(count)]

    if layout.colocated:
        shared = bundles(max(len(layout.rollout), len(layout.trainer)),
                         cpus_per_rollout + cpus_per_trainer, per_bundle=2)
        return {"rollout": shared, "trainer": shared}
    return {"rollout": bundles(len(layout.rollout), cpus_per_rollout, per_bundle=1),
            "trainer": bundles(len(layout.trainer), cpus_per_trainer, per_bundle=1)}


def _resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{name} {resources.get(name, 0.0):g}" for name in ("CPU", "GPU"))


def role_placement_groups(layout: Layout, cpus_per_rollout: int, cpus_per_trainer: int,
                          gpus: float = 0.0, *, timeout_s: float) -> dict[Role, PlacementGroup]:
    """One placement group per role (or one shared STRICT_PACK group when co-located).

    Raises ``ConfigError`` (one line: the bundles asked for and what the cluster has)
    when a group is not placed within ``timeout_s`` (run.call_timeout_s);
    the groups already asked for are removed first.
    """
    specs = role_bundles(layout, cpus_per_rollout, cpus_per_trainer, gpus)
    groups: dict[Role, PlacementGroup]
    if layout.colocated:
        shared = placement_group(specs["rollout"], strategy="STRICT_PACK")
        groups = {"rollout": shared, "trainer": shared}
    else:
        groups = {role: placement_group(bundles, "PACK") for role, bundles in specs.items()}
    unique = {id(g): g for g in groups.values()}
    try:
        ray.get([g.ready() for g in unique.values()], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for group in unique.values():
            remove_placement_group(group)
        asked = "; ".join(f"{role}: {len(bundles)} x {{{_resources(bundles[0])}}}"
                          for role, bundles in specs.items() if bundles
                          and not (layout.colocated and role == "trainer"))
        raise ConfigError(
            f"placement error: no placement within {timeout_s:g}s (run.call_timeout_s) for "
            f"{asked}; the cluster has {_resources(ray.cluster_resources())} in all") from None
    return groups


def own_roles_placement_group(count: int, cpus_each: int, gpus: float = 0.0, *,
                              timeout_s: float) -> PlacementGroup:
    """The placement group of the reference's and the critic's workers of their own
    (placement "own"): one bundle each, apart from the rollout and trainer groups.
    Raises ``ConfigError`` as ``role_placement_groups`` does."""
    return _equal_bundles(count, cpus_each, gpus, timeout_s=timeout_s, refusal=lambda asked: (
        f"placement error: no placement within {timeout_s:g}s (run.call_timeout_s) for "
        f"reference/critic: {asked}; the cluster has "
        f"{_resources(ray.cluster_resources())} in all"))


def _equal_bundles(count: int, cpus_each: int, gpus: float, *, timeout_s: float,
                   refusal: Callable[[str], str]) -> PlacementGroup:
    """``count`` equal bundles, packed, once placed; not placed within ``timeout_s``: the
    group is removed and ``ConfigError(refusal("N x {resources}"))`` raised."""
    bundle: dict[str, float] = {"CPU": float(cpus_each)} | ({"GPU": gpus} if gpus else {})
    group = placement_group([dict(bundle) for _ in range(count)], "PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ConfigError(refusal(f"{count} x {{{_resources(bundle)}}}")) from None
    return group


def check_lendable(most: int, added: int, room: int, cluster_gpus: float, *,
                   needed: int) -> None:
    """Refuses, in one line naming autopilot.max_rollout_workers (``most``), ``added``
    engines beyond rollout.num_workers that the cluster cannot hold: on GPUs, one each
    beyond the ``needed`` of the run's other workers; on CPU, more than ``room`` (the
    roster's: added engines with cores no other added engine has)."""
    key = f"config error: autopilot.max_rollout_workers = {most}"
    if cluster_gpus and needed + added > cluster_gpus:
        raise ConfigError(f"{key}: {added} engine(s) added need a GPU each beyond the run's "
                          f"{needed}, and the cluster has {cluster_gpus:g}")
    if not cluster_gpus and added > room:
        raise ConfigError(f"{key}: {added} engine(s) added, and the spare and trainer cores "
                          f"hold {room} (rollout.cpus_per_worker each)")


def lendable_placement_group(most: int, count: int, cpus_each: int, gpus: float = 0.0, *,
                             timeout_s: float) -> PlacementGroup:
    """The placement group of the ``count`` engines ``[autopilot]`` may add (up to
    autopilot.max_rollout_workers, ``most``): one bundle each, held from the start.
    Raises ``ConfigError`` naming the key when it is not placed within ``timeout_s``."""
    return _equal_bundles(count, cpus_each, gpus, timeout_s=timeout_s, refusal=lambda asked: (
        f"config error: autopilot.max_rollout_workers = {most}: no placement within "
        f"{timeout_s:g}s (run.call_timeout_s) for {count} engine(s) added: {asked}; the "
        f"cluster has {_resources(ray.cluster_resources())} in all"))


def in_bundle(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    """Scheduling strategy that puts an actor in one bundle of a placement group."""
    return PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index
    )


def bundle_node(group: PlacementGroup, index: int) -> tuple[str, str]:
    """(node id, IP address) of the node that placement group bundle ``index`` is on."""
    node_id = str(placement_group_table(group)["bundles_to_node_id"][index])
    ip = next(str(n["NodeManagerAddress"]) for n in ray.nodes() if n["NodeID"] == node_id)
    return node_id, ip
