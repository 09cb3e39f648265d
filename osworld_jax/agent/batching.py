"""Owners -> group policy (the estimator's inputs, built once) -> a padded ``Batch``.

One logical owner has one reward and one advantage, however many segments (rows) it has.
`select_groups` returns the kept owners with their reward / validity / group arrays; the RL loop
feeds those to the jitted estimator (``osworld_jax.algorithms.compute_advantages``) and hands
the advantages back to `pack_batch`, which fans each one out to every trainable token of every
row of its owner (``owner_ids`` lets ``aggregate_loss`` treat the owner's rows as one sequence).

Screenshots (`VisionPacking`): each distinct PNG of the batch is stored once (`RowImages`), rows
referring to it; the trainer makes the patches with the model's own image processor (the
algorithm the server ran on the same bytes) per device shard. Positions become the M-RoPE
``i32[3, R, T]`` of ``mrope_positions``. NumPy + Pillow only (no jax).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from osworld_jax.agent.config import BaselinePopulation, GroupPolicyConfig
from osworld_jax.agent.errors import GroupPolicyError, PackingError
from osworld_jax.agent.owner import OwnerRollout
from osworld_jax.agent.segments import Segment
from osworld_jax.batch import Batch, RowImages, check_batch, route_dtype
from osworld_jax.errors import ConfigError
from osworld_jax.model.mrope import mrope_positions
from osworld_jax.model.processor import ImageProcessor
from osworld_jax.model.vl_config import Qwen3VLMoeConfig
from osworld_jax.registry import check_choice


@dataclass(frozen=True, kw_only=True, eq=False)
class GroupSelection:
    """The owners a step trains on, and the estimator's inputs over them (built once).

    Attributes:
      owners: the kept owners, in input order.
      dropped_group_ids: prompt groups dropped for too few healthy owners.
      rewards: f32[N] reward per kept owner (0 for failed owners).
      valid: bool[N] owners in the baseline population, each once
        (``GroupPolicyConfig.baseline_population``): ``logical_owners``, the owners with a
        known reward (not ``failed``); ``all_owners``, every owner (a failed one as a
        placeholder: reward 0, token count 0).
      failed: bool[N] owners masked for an infrastructure failure.
      group_index: i32[N] dense group index in ``[0, num_groups)`` (rank of the sorted ids).
      num_groups: number of kept groups.
      token_counts: f32[N] trainable tokens per owner, over all its segments (0 for failed
        owners: their row is masked).
      owner_index: i32[N] each owner's id in a packed batch (``Batch.owner_ids``): its index
        in the step's whole selection. ``arange(N)`` by default; a `split_selection` part keeps
        the whole selection's ids (and ``group_index`` / ``num_groups``), so its batch's ids
        are those of the same rows in the whole batch, within the same ``BatchBounds``.
    """

    owners: tuple[OwnerRollout, ...]
    dropped_group_ids: tuple[int, ...]
    rewards: np.ndarray
    valid: np.ndarray
    failed: np.ndarray
    group_index: np.ndarray
    num_groups: int
    token_counts: np.ndarray
    owner_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def __post_init__(self) -> None:
        if self.owner_index.size == 0 and self.owners:
            object.__setattr__(self, "owner_index", np.arange(len(self.owners), dtype=np.int32))
        if self.owner_index.shape != (len(self.owners),):
            raise PackingError(
                f"GroupSelection.owner_index: shape {self.owner_index.shape} for "
                f"{len(self.owners)} owners"
            )

    @classmethod
    def of(
        cls,
        owners: Sequence[OwnerRollout],
        baseline_population: BaselinePopulation = "logical_owners",
        dropped_group_ids: tuple[int, ...] = (),
    ) -> GroupSelection:
        """The selection of exactly ``owners`` (no group policy applied).

        Failed owners (infrastructure failures, stale-masked: unknown rewards) have reward 0 and
        token count 0. ``logical_owners``: they are never ``valid`` (``valid`` is every owner
        with a known reward, once). ``all_owners``: every owner is ``valid``, a failed one a
        placeholder of reward 0 in its group's statistics. Either way a failed owner's own
        advantage is 0 (`osworld_jax.rl.stages.owner_advantages`). Group indices are the rank
        of each owner's ``group_id`` among the sorted distinct ids.
        """
        check_choice(baseline_population, BaselinePopulation, "baseline_population")
        owners = tuple(owners)
        failed = np.array([o.failed for o in owners], bool)
        rewards = np.array([0.0 if o.failed else float(o.reward or 0.0) for o in owners])
        ids = np.array([o.group_id for o in owners], np.int64)
        uniq, index = np.unique(ids, return_inverse=True)
        return cls(
            owners=owners,
            dropped_group_ids=dropped_group_ids,
            rewards=rewards.astype(np.float32),
            valid=np.ones_like(failed) if baseline_population == "all_owners" else ~failed,
            failed=failed,
            group_index=index.astype(np.int32).reshape(-1),
            num_groups=int(uniq.size),
            token_counts=np.array([0 if o.failed else o.num_trainable for o in owners], np.float32),
        )


def select_groups(
    owners: Sequence[OwnerRollout], config: GroupPolicyConfig, num_prompts: int
) -> GroupSelection:
    """Applies the group policy to a step's owners.

    A group with fewer than ``min_healthy_per_group`` healthy owners is dropped (``shrink``) or
    fails the step (``fail``); fewer than ``ceil(min_step_batch_fraction * num_prompts)`` kept
    groups fail the step.

    Args:
      owners: every owner of the step (failed ones included).
      config: the group policy.
      num_prompts: B, the number of prompt groups the step asked for.

    Returns:
      The kept owners and their estimator inputs.

    Raises:
      GroupPolicyError: a group was dropped under ``fail``, or too few groups remain.
    """
    healthy: dict[int, int] = {}
    for o in owners:
        healthy[o.group_id] = healthy.get(o.group_id, 0) + (not o.failed)
    dropped = tuple(sorted(g for g, n in healthy.items() if n < config.min_healthy_per_group))
    if dropped and config.on_dropped_group == "fail":
        raise GroupPolicyError(
            f"groups {list(dropped)} have fewer than min_healthy_per_group="
            f"{config.min_healthy_per_group} healthy owners (on_dropped_group='fail')"
        )
    kept = tuple(o for o in owners if o.group_id not in dropped)
    num_kept = len(healthy) - len(dropped)
    need = math.ceil(config.min_step_batch_fraction * num_prompts - 1e-9)
    if num_kept < need:
        raise GroupPolicyError(
            f"only {num_kept} of {num_prompts} prompt groups have >= "
            f"{config.min_healthy_per_group} healthy owners; the step needs at least {need} "
            f"(min_step_batch_fraction={config.min_step_batch_fraction}); dropped groups: "
            f"{list(dropped)}"
        )
    return GroupSelection.of(kept, config.baseline_population, dropped)


def split_selection(
    selection: GroupSelection, advantages: Sequence[float] | np.ndarray, num_minibatches: int
) -> list[tuple[GroupSelection, np.ndarray]]:
    """Splits a step's selection into minibatches of whole prompt groups (one update each).

    The groups, in ``group_index`` order, are cut into ``k = min(num_minibatches, G)``
    contiguous runs of ``ceil`` / ``floor(G / k)`` groups, the larger first (5 groups into 2:
    groups 0-2 then 3-4; 7 into 3: 3 + 2 + 2); a group never spans two minibatches (its
    owners, failed ones included, stay together: the estimator's and the loss's unit). Owners
    keep their selection order within a part. Fewer groups than ``num_minibatches`` (groups
    dropped by the group policy) give fewer minibatches, one group each, not an error:
    ``Trainer.train_minibatches`` takes 1 to ``num_minibatches`` of them. An empty selection or
    ``num_minibatches == 1`` is one part: ``(selection, advantages)`` themselves, so the packed
    batch is the one-update batch.

    Advantages are computed once over the whole selection (the estimator's baseline sees every
    owner of a group) and only sliced here, never recomputed per minibatch. Each part keeps
    the whole selection's owner ids (``owner_index``), ``group_index`` and ``num_groups``, so
    ``pack_batch`` of a part gives the whole batch's rows of those owners with the same ids,
    within the same ``BatchBounds``.

    Loss normalisation: each update normalises its loss over its own minibatch (the owners,
    groups and tokens of that part), as PPO / verl / slime minibatches do; e.g. under
    ``prompt-mean-token-mean`` a group weighs ``1 / G_i`` in update i, not ``1 / G``.

    Args:
      selection: the step's selection (``select_groups``).
      advantages: f32[N] one advantage per selected owner, computed over the whole selection.
      num_minibatches: the updates per rollout batch (``TrainerConfig.num_minibatches``), >= 1.

    Returns:
      ``[(part selection, f32[N_i] its owners' advantages), ...]``, 1 to ``num_minibatches``
      parts, in group order.

    Raises:
      ConfigError: ``num_minibatches < 1``.
      PackingError: ``advantages`` does not have one value per owner.
    """
    if num_minibatches < 1:
        raise ConfigError(f"split_selection: num_minibatches {num_minibatches} < 1")
    adv = np.asarray(advantages, np.float32).reshape(-1)
    n = len(selection.owners)
    if adv.size != n:
        raise PackingError(f"split_selection: {adv.size} advantages for {n} owners")
    groups = np.unique(selection.group_index)  # the groups present, ascending
    k = min(num_minibatches, groups.size)
    if k <= 1:
        return [(selection, adv)]
    parts = []
    for run in np.array_split(groups, k):  # contiguous, sizes differ by at most 1, larger first
        keep = np.flatnonzero(np.isin(selection.group_index, run))
        part = GroupSelection(
            owners=tuple(selection.owners[i] for i in keep),
            dropped_group_ids=selection.dropped_group_ids,
            rewards=selection.rewards[keep],
            valid=selection.valid[keep],
            failed=selection.failed[keep],
            group_index=selection.group_index[keep],
            num_groups=selection.num_groups,
            token_counts=selection.token_counts[keep],
            owner_index=selection.owner_index[keep],
        )
        parts.append((part, adv[keep]))
    return parts


def bucket_length(n: int, length_buckets: Sequence[int] | None, min_length: int = 128) -> int:
    """The padded row length T for a longest row of ``n`` tokens.

    With ``length_buckets`` the smallest bucket ``>= n``; otherwise the next power of two
    ``>= max(n, min_length)``.
    """
    if length_buckets:
        for b in sorted(length_buckets):
            if b >= n:
                return int(b)
        raise PackingError(
            f"a row of {n} tokens exceeds the largest length bucket {max(length_buckets)}"
        )
    return 1 << max(max(n, min_length, 1) - 1, 0).bit_length()


def _num_rows(n: int, dp_size: int, row_buckets: Sequence[int] | None) -> int:
    r = max(n, 1)
    if row_buckets:
        fits = [b for b in sorted(row_buckets) if b >= r]
        if not fits:
            raise PackingError(f"{r} rows exceed the largest row bucket {max(row_buckets)}")
        r = fits[0]
    return -(-r // dp_size) * dp_size


@dataclass(frozen=True, kw_only=True, eq=False)
class VisionPacking:
    """How `pack_batch` lays out the segments' screenshots for a Qwen3-VL-MoE policy.

    Attributes:
      processor: the model's image processor (``ImageProcessor.from_pretrained(model_dir)``),
        the same algorithm the server ran on the same PNG bytes.
      config: the model's `Qwen3VLMoeConfig` (image token id, merge size: M-RoPE positions).
      patch_buckets: allowed per-row patch counts, ascending (the train step compiles once per
        bucket): the smallest that holds a batch's largest row is used; beyond the largest,
        the next power of two. Empty: powers of two (at least ``merge_size^2``).
      image_slots: the image slots per row (the ``m`` of ``image_grid_thw [R, m, 3]``) of
        every batch whose rows hold at most this many images; more images in a row round it
        up to a power of two.
    """

    processor: ImageProcessor
    config: Qwen3VLMoeConfig
    patch_buckets: tuple[int, ...] = ()
    image_slots: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_buckets", tuple(int(b) for b in self.patch_buckets))
        m2 = self.config.vision.spatial_merge_size**2
        if any(b % m2 for b in self.patch_buckets):
            raise PackingError(
                f"VisionPacking.patch_buckets {self.patch_buckets}: each must be a multiple of "
                f"merge_size^2 = {m2}"
            )
        if self.image_slots < 1:
            raise PackingError(f"VisionPacking.image_slots must be >= 1, got {self.image_slots}")

    def patch_bucket(self, patches: int) -> int:
        """The padded per-row patch count for a largest row of ``patches``."""
        for b in sorted(self.patch_buckets):
            if b >= patches:
                return b
        m2 = self.config.vision.spatial_merge_size**2
        return 1 << (max(patches, m2) - 1).bit_length()


def _image_grid(png: bytes, processor: ImageProcessor) -> np.ndarray:
    """i32[3] the processor's patch grid of an encoded image, from its header (not decoded)."""
    try:
        with Image.open(io.BytesIO(png)) as image:
            width, height = image.size
    except Exception as e:  # Pillow raises several types for corrupt data
        raise PackingError(f"a segment's image is not a decodable image ({e})") from None
    return np.asarray(processor.grid_thw(height, width), np.int32)


def _row_vision(
    rows: list[list[Segment]], vision: VisionPacking
) -> tuple[RowImages, np.ndarray] | None:
    """(the rows' `RowImages`, image_grid_thw i32[R, m, 3]), or None (no image).

    Each distinct PNG is stored once (its bytes, as the server got them), row r's slot k
    referring to row r's k-th image (its segments' images in token order); the patch counts
    come from the images' sizes (`ImageProcessor.grid_thw`), no image is decoded here.
    """
    ids: dict[bytes, int] = {}
    grids: list[np.ndarray] = []
    per_row: list[list[int]] = []
    for segs in rows:
        items = []
        for seg in segs:
            for png in seg.images:
                if png not in ids:
                    ids[png] = len(ids)
                    grids.append(_image_grid(png, vision.processor))
                items.append(ids[png])
        per_row.append(items)
    if not ids:
        return None
    most = max(len(x) for x in per_row)
    # image_slots holds every row of a run (its most screenshots per segment), so the step
    # compiles one m; only a row beyond it rounds up to a power of two.
    slots = vision.image_slots if most <= vision.image_slots else 1 << (most - 1).bit_length()
    sizes = [int(np.prod(g)) for g in grids]
    patches = vision.patch_bucket(max(sum(sizes[i] for i in x) for x in per_row))
    index = np.full((len(rows), slots), -1, np.int32)
    grid_thw = np.zeros((len(rows), slots, 3), np.int32)
    for r, items in enumerate(per_row):
        for k, i in enumerate(items):
            index[r, k] = i
            grid_thw[r, k] = grids[i]
    images = RowImages(
        encoded=tuple(ids),
        grid_thw=np.stack(grids),
        index=index,
        num_patches=patches,
        processor=vision.processor,
    )
    return images, grid_thw


def _row_segments(
    rows: list[tuple[int, int, Segment | None]], t: int, pack_segments: bool
) -> list[tuple[int, int, list[Segment]]]:
    """Groups consecutive segments of one owner into rows of at most ``t`` tokens (if packing)."""
    out: list[tuple[int, int, list[Segment]]] = []
    for i, g, seg in rows:
        if seg is None:
            out.append((i, g, []))
            continue
        last = out[-1] if out else None
        if (
            pack_segments
            and last is not None
            and last[0] == i
            and last[2]
            and sum(s.length for s in last[2]) + seg.length <= t
        ):
            last[2].append(seg)
        else:
            out.append((i, g, [seg]))
    return out


def pack_batch(
    selection: GroupSelection,
    advantages: Sequence[float] | np.ndarray,
    *,
    num_layers: int,
    top_k: int,
    num_experts: int | None = None,
    dp_size: int = 1,
    length_buckets: Sequence[int] | None = None,
    min_length: int = 128,
    row_buckets: Sequence[int] | None = None,
    pack_segments: bool = False,
    vision: VisionPacking | None = None,
) -> Batch:
    """Packs the selected owners' segments into padded rows.

    Row order: owners in selection order, each owner's segments in order, one per row (with
    ``pack_segments``: consecutive segments of one owner share a row while they fit in T,
    ``segment_ids`` 1, 2, ... and positions restarting at each); a failed owner is one fully
    masked placeholder row (row weight 0); padding rows (row weight 0, owner 0, group 0) bring
    R to a multiple of ``dp_size`` (after ``row_buckets``). ``owner_ids[r]`` is the owner's
    ``selection.owner_index`` (its index in ``selection.owners``, < N, unless the selection is
    a `split_selection` part: then its index in the whole selection); ``group_ids[r]`` its
    ``selection.group_index`` (< ``num_groups``).
    ``advantages[t] = advantage[owner] * loss_mask[t]``.

    With ``vision``: ``positions`` are the M-RoPE i32[3, R, T] (`mrope_positions`; text-only
    rows get three equal rows) and, when any segment has screenshots, ``images`` (`RowImages`)
    stores each distinct screenshot of the batch once (its PNG bytes) with row r's slot k
    referring to row r's k-th image (the images of its segments in token order), and
    ``image_grid_thw`` i32[R, m, 3] their patch grids (t = 0: unused slot). ``pixel_values``
    stays None: row r's patches (back to back, padded to a patch bucket ``Np``) are made from
    ``images`` by the trainer per device shard (``batch.with_pixel_values`` for all rows). Image
    tokens keep loss mask 0 (they are prompt tokens).

    Args:
      selection: the step's owners and groups (``select_groups`` or ``GroupSelection.of``).
      advantages: f32[N] one advantage per selected owner.
      num_layers: L of ``routed_experts``.
      top_k: K of ``routed_experts``.
      num_experts: E of the model: ``routed_experts`` takes `route_dtype` (int8 for up to 128
        experts; None: int32).
      dp_size: the data-parallel size R must be a multiple of.
      length_buckets: allowed T values (else next power of two >= max(len, ``min_length``)).
      min_length: the smallest power-of-two T.
      row_buckets: allowed R values before rounding to ``dp_size`` (bounds recompiles).
      pack_segments: put consecutive segments of one owner into one row when they fit.
      vision: the image layout of a Qwen3-VL policy (None: a text model).

    Returns:
      The `Batch` (checked against the contract).
    """
    owners, group_index = selection.owners, selection.group_index
    adv = np.asarray(advantages, np.float32).reshape(-1)
    if adv.size != len(owners):
        raise PackingError(f"{adv.size} advantages for {len(owners)} owners")
    if dp_size < 1:
        raise PackingError(f"dp_size must be >= 1, got {dp_size}")
    flat: list[tuple[int, int, Segment | None]] = []  # (owner index, group index, segment)
    for i, o in enumerate(owners):
        if o.failed or not o.segments:
            flat.append((i, int(group_index[i]), None))
        else:
            flat.extend((i, int(group_index[i]), s) for s in o.segments)
    longest = max((s.length for _, _, s in flat if s is not None), default=1)
    t = bucket_length(longest, length_buckets, min_length)
    rows = _row_segments(flat, t, pack_segments)
    r = _num_rows(len(rows), dp_size, row_buckets)
    tokens = np.zeros((r, t), np.int32)
    loss_mask = np.zeros((r, t), np.float32)
    behavior = np.zeros((r, t), np.float32)
    advantages_rt = np.zeros((r, t), np.float32)
    segment_ids = np.zeros((r, t), np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (r, t)).copy()
    owner_ids = np.zeros((r,), np.int32)
    group_ids = np.zeros((r,), np.int32)
    row_weight = np.zeros((r,), np.float32)
    routes = np.full((r, t, num_layers, top_k), -1, route_dtype(num_experts))
    route_max = np.iinfo(routes.dtype).max
    for row, (i, g, segs) in enumerate(rows):
        owner_ids[row] = selection.owner_index[i]
        group_ids[row] = g
        at = 0
        for k, seg in enumerate(segs):
            n = seg.length
            span = slice(at, at + n)
            tokens[row, span] = seg.tokens
            loss_mask[row, span] = seg.loss_mask
            behavior[row, span] = seg.behavior_logprobs
            advantages_rt[row, span] = adv[i] * seg.loss_mask
            segment_ids[row, span] = k + 1
            positions[row, span] = np.arange(n)
            row_weight[row] = 1.0
            if seg.routed_experts is not None:
                if seg.routed_experts.shape[1:] != (num_layers, top_k):
                    raise PackingError(
                        f"owner {i}: routed_experts [L, K] = {seg.routed_experts.shape[1:]}, "
                        f"expected ({num_layers}, {top_k})"
                    )
                if int(seg.routed_experts.max(initial=-1)) > route_max:
                    raise PackingError(
                        f"owner {i}: routed_experts holds expert id "
                        f"{int(seg.routed_experts.max())}, the model has {num_experts} experts"
                    )
                routes[row, span] = seg.routed_experts
            at += n
        positions[row, at:] = np.arange(t - at) + (positions[row, at - 1] + 1 if at else 0)
    images = image_grid_thw = None
    if vision is not None:
        stored = _row_vision([segs for _, _, segs in rows] + [[]] * (r - len(rows)), vision)
        if stored is not None:
            images, image_grid_thw = stored
        positions = mrope_positions(tokens, image_grid_thw, vision.config, segment_ids=segment_ids)
    batch = Batch(
        tokens=tokens,
        loss_mask=loss_mask,
        behavior_logprobs=behavior,
        advantages=advantages_rt,
        positions=positions,
        segment_ids=segment_ids,
        owner_ids=owner_ids,
        group_ids=group_ids,
        row_weight=row_weight,
        routed_experts=routes,
        image_grid_thw=image_grid_thw,
        images=images,
    )
    check_batch(batch)
    return batch
