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

from .candidates import Result, timm_port
from .precision import CheckpointPrecision, LabelledImages, checkpoint_precision, load_calibration, load_labelled
from .report import format_table, plot, write_report
from .run import BenchConfig, BenchProtocol, BenchReport, measure_table, run_bench
from .train_speed import train_throughput

__all__ = [
    "BenchConfig",
    "BenchProtocol",
    "BenchReport",
    "CheckpointPrecision",
    "LabelledImages",
    "Result",
    "checkpoint_precision",
    "format_table",
    "load_calibration",
    "load_labelled",
    "measure_table",
    "plot",
    "run_bench",
    "timm_port",
    "train_throughput",
    "write_report",
]
