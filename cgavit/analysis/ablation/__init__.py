"""The ablation ladder (design notes, chapters 2-7), trained under one budget and measured side by side.

Rungs, each adding one idea to the one before:

1. ``standard``: one attention then one FFN per block (``ffn_per_side=(0, 1)``), every head reads all
   channels (``group_split`` off, ``cascade`` off), tied widths ``key_dim = value width = C/h``
   (``attn_ratio=1``), FFN ratio 4. Its depth is raised until its parameter count is closest to
   rung 2's (the paper compares the layouts at similar size; :func:`match_depth`).
2. ``sandwich``: the sandwich layout, one dw+FFN pair each side of the attention (``ffn_per_side=1``).
3. ``groups``: each head reads its own channel group (``group_split`` on).
4. ``cascade``: each head's output is added to the next head's input (``cascade`` on).
5. ``realloc``: parameter reallocation: narrow Q/K (``key_dim=16``), wide V (the default
   ``value width = C/h``), FFN ratio 2. This is the paper's block.

Every (rung, seed) trains in its own folder with :func:`cgavit.train.train` and writes ``result.json``
when measured; a study that is stopped continues where it was, and a run stopped mid-training
resumes from its last checkpoint (:meth:`cgavit.train.TrainConfig.resume_from`). The summary
(``ablation.json``, ``ablation_table.md``, PNG plots) is rebuilt from the result files, with CPU
throughput of all rungs measured together, round-robin (:func:`cgavit.timing.round_robin`).

One module per job: :mod:`.ladder` (the rungs' dials, depth matching), :mod:`.config`
(:class:`AblationConfig`), :mod:`.runs` (one (rung, seed): train or continue, measure),
:mod:`.throughput` (CPU speed of all rungs), :mod:`.summary` (rows, table, plots) and :mod:`.study`
(:func:`run_ablation`, the whole study).
"""

from .config import AblationConfig
from .ladder import RUNGS, Variant, build_ladder, match_depth, rung_dials
from .runs import StudyStopped
from .study import StudySummary, run_ablation
from .throughput import measure_throughput

__all__ = [
    "RUNGS",
    "AblationConfig",
    "StudyStopped",
    "StudySummary",
    "Variant",
    "build_ladder",
    "match_depth",
    "measure_throughput",
    "run_ablation",
    "rung_dials",
]
