"""``cgavit bench``: the paper's throughput protocol, our models beside timm's port and peers, same run.

Protocol (the official speed test): BatchNorm fused, grad off, warm-up, then timed repeats.
CPU: 1 thread, batch 16, fp32. GPU: batch 2048, AMP (fp16 autocast), CUDA-event timing.
Every candidate is timed round-robin (:func:`cgavit.timing.round_robin`: one batch each, in turn)
so that load from other processes hits all of them alike; the table reports the median and the
interquartile range over repeats, and each EfficientViT row's ratio to timm's traced port of the
same variant with the same weights.

One module per job:

- ``candidates``: the main table's inference paths (ours, timm's port, timm's peers) and their timing.
- ``ceiling``: on the CPU in fp32, each variant's FLOPs at the measured matmul peak, beside the table.
- ``precision``: every inference path (fp32, bf16, int8; torch and the runtimes) timed and compared
  with fp32 on real labelled images, on a trained checkpoint.
- ``train_speed``: training-step throughput against timm's port.
- ``report``: text tables, the environment record, bench.csv/json and the plot.
- ``run``: :class:`BenchConfig` -> :func:`run_bench` -> :class:`BenchReport`.
- ``optional``: the one place the heavy optional dependencies (timm, matplotlib) are imported, on
  first use.

Example::

    from cgavit.bench import BenchConfig, run_bench

    report = run_bench(BenchConfig(models=("m0",), peers=(), repeats=10, out=None))
    for r in report.results:
        print(r.name, r.median)
"""

from .candidates import PEERS_TOP1, Candidate, Result, build_candidates, peer_model, time_candidates, timm_port, trace
from .ceiling import CeilingRow, fp32_ceilings, format_ceilings
from .precision import (
    RUNTIMES,
    CheckpointPrecision,
    LabelledImages,
    PrecisionRow,
    checkpoint_precision,
    inference_paths,
    load_labelled,
)
from .report import (
    BATCH_NOTE,
    PRECISION_NOTE,
    TABLE_NOTE,
    environment,
    format_auto,
    format_auto_order,
    format_precision_table,
    format_table,
    format_training,
    plot,
    precision_note,
    write_report,
)
from .run import BenchConfig, BenchProtocol, BenchReport, measure_table, resolve_protocol, run_bench
from .train_speed import TrainingRow, train_throughput

__all__ = [
    "BATCH_NOTE",
    "BenchConfig",
    "BenchProtocol",
    "BenchReport",
    "Candidate",
    "CeilingRow",
    "CheckpointPrecision",
    "LabelledImages",
    "PEERS_TOP1",
    "PRECISION_NOTE",
    "PrecisionRow",
    "RUNTIMES",
    "Result",
    "TABLE_NOTE",
    "TrainingRow",
    "build_candidates",
    "checkpoint_precision",
    "environment",
    "format_auto",
    "format_auto_order",
    "format_ceilings",
    "format_precision_table",
    "format_table",
    "format_training",
    "fp32_ceilings",
    "inference_paths",
    "load_labelled",
    "measure_table",
    "peer_model",
    "plot",
    "precision_note",
    "resolve_protocol",
    "run_bench",
    "time_candidates",
    "timm_port",
    "trace",
    "train_throughput",
    "write_report",
]
