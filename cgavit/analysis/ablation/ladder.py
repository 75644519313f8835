"""The ablation ladder: the five rungs' design dials, and rung 1's depth matched in parameters to
rung 2's (:func:`match_depth`). The rungs are described in :mod:`cgavit.analysis.ablation`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ...factory import create_model, resolve_name
from ...reallocation import allocation_dials
from ...variants import CONFIG_LIMITS, VARIANTS

RUNGS = ("standard", "sandwich", "groups", "cascade", "realloc")
RUNG_TITLES = {
    "standard": "1 standard (attn+FFN, MHSA, tied Q/K/V, FFN x4)",
    "sandwich": "2 + sandwich layout",
    "groups": "3 + channel groups",
    "cascade": "4 + cascade",
    "realloc": "5 + reallocation (Q/K 16, FFN x2)",
}
ARCH_FIELDS = ("embed_dim", "depth", "num_heads", "window_size", "kernels")


def _base_arch(model: str, overrides: dict) -> dict:
    """The base architecture fields (widths, depths, heads, windows, kernels) with overrides."""
    cfg = VARIANTS[resolve_name(model)].cfg.with_dials(**overrides)
    return {f: tuple(getattr(cfg, f)) for f in ARCH_FIELDS}


def count_params(model_name: str, dials: dict, num_classes: int, img_size: int) -> int:
    """Parameters of ``model_name`` built with ``dials``."""
    m = create_model(model_name, num_classes=num_classes, img_size=img_size, **dials)
    return sum(p.numel() for p in m.parameters())


def rung_dials(rung: str, arch: dict, common: dict | None = None) -> dict:
    """The design dials of one rung on top of the base architecture ``arch`` (depth not matched), then
    ``common``, the dials every rung is built with (they win over the rung's).

    Rungs 1-4 use the uniform allocation of :mod:`cgavit.reallocation` (Q/K = V = C/h, FFN x4);
    rung 5 reallocates (Q/K 16, V C/h, FFN x2): the dials are that module's, written out.
    """
    if rung not in RUNGS:
        raise ValueError(f"unknown rung {rung!r}; choose from {', '.join(RUNGS)}")
    scheme = "paper" if RUNGS.index(rung) >= 4 else "uniform"
    d = dict(arch)
    d.update(ffn_per_side=(0, 1), group_split=False, cascade=False)
    d.update({k: v for k, v in allocation_dials(scheme, arch["embed_dim"], arch["num_heads"]).items() if v is not None})
    if RUNGS.index(rung) >= 1:
        d["ffn_per_side"] = (1, 1)
    if RUNGS.index(rung) >= 2:
        d["group_split"] = True
    if RUNGS.index(rung) >= 3:
        d["cascade"] = True
    d.update(common or {})
    return d


def _block_params(model_name: str, dials: dict, num_classes: int, img_size: int) -> tuple[int, tuple[int, ...]]:
    """Parameters of ``model_name`` built with ``dials``, and of one sandwich block of each stage: every block of
    a stage is built alike, so the count at another depth is the total plus the blocks added or removed."""
    m = create_model(model_name, num_classes=num_classes, img_size=img_size, **dials)
    per_block = []
    for stage in m.stages:
        counts = {sum(p.numel() for p in blk.parameters()) for blk in stage.blocks}
        assert len(counts) == 1, "the blocks of a stage differ in size"
        per_block.append(counts.pop())
    return sum(p.numel() for p in m.parameters()), tuple(per_block)


def depth_candidates(base: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The depths :func:`match_depth` chooses rung 1's from: every non-decreasing ``(d1 <= d2 <= d3)`` with
    ``base_i <= d_i <= 2 * base_i + 1`` and at most ``CONFIG_LIMITS["depth"]``'s largest depth.

    Raises:
        ValueError: there is none (a base depth such as 32, 1, 1), naming ``--depth`` and a base that has some.
    """
    limit = CONFIG_LIMITS["depth"][1]
    ranges = [range(b, min(2 * b + 1, limit) + 1) for b in base]
    found = [d for d in itertools.product(*ranges) if all(a <= b for a, b in zip(d, d[1:]))]  # the base's profile
    if not found:
        raise ValueError(f"rung 1 cannot be matched in parameters to the base depth {','.join(map(str, base))} (--depth): "
                         f"it searches depths d1 <= d2 <= d3 from the base's up to 2 x base + 1 (at most {limit}), and none "
                         f"of those is non-decreasing; give a --depth whose entries do not decrease, e.g. "
                         f"--depth {','.join(map(str, sorted(base)))}")
    return found


def match_depth(
    model_name: str, arch: dict, num_classes: int, img_size: int, common: dict | None = None
) -> tuple[tuple[int, int, int], int, int]:
    """Depth for rung 1 whose parameter count is closest to rung 2's.

    Searches every non-decreasing depth ``(d1 <= d2 <= d3)`` with ``base_i <= d_i <= 2 * base_i + 1``, and at
    most the largest depth a config may have (``CONFIG_LIMITS["depth"]``); ties go to the smaller total depth.
    Rung 1's count at each depth is its count at the base depth plus that of the blocks added (every block
    of a stage has as many parameters), so one model is built for rung 1, not one per depth.

    Returns:
        ``(depth, params of rung 1 at that depth, params of rung 2)``.

    Raises:
        ValueError: no depth in that range is non-decreasing (a base depth such as 32, 1, 1; :func:`depth_candidates`).
    """
    base = tuple(arch["depth"])
    candidates = depth_candidates(base)  # first: a base it cannot match is refused before a model is built
    target = count_params(model_name, rung_dials("sandwich", arch, common), num_classes, img_size)
    total, per_block = _block_params(model_name, rung_dials("standard", arch, common), num_classes, img_size)
    best = None
    for depth in candidates:
        n = total + sum((d - b) * p for d, b, p in zip(depth, base, per_block))
        key = (abs(n - target), sum(depth))
        if best is None or key < best[0]:
            best = (key, depth, n)
    return best[1], best[2], target


def match_rule(base: tuple[int, ...]) -> str:
    """The rule :func:`match_depth` follows for ``base``, as the study's ``matching`` note states it (the bound on
    a depth is named only where it cuts the range, so a study matched before it was applied reads the same)."""
    limit = CONFIG_LIMITS["depth"][1]
    bound = f" and d_i <= {limit}" if any(2 * b + 1 > limit for b in base) else ""
    return f"rung 1 depth: the non-decreasing (d1, d2, d3) with base_i <= d_i <= 2*base_i+1{bound} whose parameter count is closest to rung 2's"


@dataclass
class Variant:
    """One rung of the ladder: its name and the full dial set it is built with."""

    rung: str
    dials: dict

    @property
    def title(self) -> str:
        return RUNG_TITLES[self.rung]


def base_architecture(model_name: str, arch_overrides: dict, common: dict | None = None) -> tuple[dict, dict]:
    """The ladder's base architecture and the dials every rung is built with besides it, as :func:`build_ladder` takes
    them apart; a study checks its options with it before it writes anything (:meth:`AblationConfig.validate`).

    Returns:
        ``(arch, rest)``: the :data:`ARCH_FIELDS` of ``model_name`` with ``arch_overrides`` and those ``common`` sets,
        and ``common``'s other dials.

    Raises:
        ValueError: ``common`` sets an architecture field that ``arch_overrides`` sets to another value, or rung 1
            cannot be matched to the base depth (:func:`depth_candidates`).
    """
    rest = dict(common or {})
    base = {k: tuple(rest.pop(k)) for k in ARCH_FIELDS if k in rest}
    clash = [k for k, v in base.items() if k in arch_overrides and tuple(arch_overrides[k]) != v]
    if clash:
        raise ValueError(f"--train-args sets {', '.join(clash)} to other values than the study's own option(s) do; "
                         "give the base architecture once")
    arch = _base_arch(model_name, {**arch_overrides, **base})
    depth_candidates(arch["depth"])
    return arch, rest


def build_ladder(
    model_name: str, arch_overrides: dict, num_classes: int, img_size: int, rungs=RUNGS, common: dict | None = None
) -> tuple[list[Variant], dict]:
    """The variants to train, and a note on the parameter matching done.

    Args:
        arch_overrides: base architecture fields (:data:`ARCH_FIELDS`) over ``model_name``'s.
        common: dials every rung is built with (``cgavit ablate --train-args``'): architecture fields among them
            are the base's, as ``arch_overrides`` are; the others win over each rung's own, and count in the matching.

    Raises:
        ValueError: as :func:`base_architecture` does.
    """
    arch, common = base_architecture(model_name, arch_overrides, common)
    depth, p1, p2 = match_depth(model_name, arch, num_classes, img_size, common)
    note = dict(
        base_depth=list(arch["depth"]),
        standard_depth=list(depth),
        standard_params=p1,
        sandwich_params=p2,
        rule=match_rule(arch["depth"]),
    )
    out = []
    for r in rungs:
        d = rung_dials(r, arch, common)
        if r == "standard":
            d["depth"] = depth
        out.append(Variant(r, d))
    return out, note
