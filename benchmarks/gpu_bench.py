"""GPU inference: timm's compiled port against cgavit's compiled paths and the fused Triton CGA kernel.

Run by ``benchmarks/gpu.sh`` (see there; needs a CUDA GPU, timm and triton). For each variant, all
paths share one random-weight model (BatchNorm statistics randomised) and are timed round-robin by
:func:`cgavit.timing.round_robin` in the same run:

- ``timm port, compile``: timm's ``efficientvit_msra`` with the same weights, BatchNorm folded by
  timm, ``torch.compile`` with inductor's freezing (the anchor, ratio 1.00);
- ``cgavit fuse, compile``: ``cgavit.fuse``, plain fused attention, same compile;
- ``cgavit triton, compile``: ``fuse`` + :func:`cgavit.kernels.module.swap_triton_modules` (the
  fused CGA kernel, output projection included), inductor for the rest;
- ``cgavit triton, eager``: the same without compile (the kernel alone against the plain path).

All in fp16 weights and input, channels-last. Throughput at the large batch (images/s, median over
rounds), latency at the small batches (ms per batch, median). One compile per path with a dynamic
batch dimension covers every batch size. Each path is checked against the fp32 fused model.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from cgavit import kernels
from cgavit.bench import timm_port
from cgavit.cli.types import image_side, variant_name, whole_number
from cgavit.deploy import fuse
from cgavit.factory import create_model
from cgavit.testing import randomize_, rel_err
from cgavit.timing import Timings, round_robin

log = logging.getLogger("gpu_bench")
ANCHOR = "timm port, compile"


def compiled(model: nn.Module, example: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``torch.compile`` with inductor's freezing (weights as constants), batch dimension dynamic
    (batch 1 gets its own compile: dynamo specialises sizes of 1); compiled here, on ``example``, so
    that the timing never includes a compile."""
    torch._inductor.config.freezing = True
    fn = torch.compile(model)
    torch._dynamo.mark_dynamic(example, 0)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(example)
    log.info("compiled in %.0f s", time.perf_counter() - t0)
    return fn


def paths(name: str, size: int, example: torch.Tensor) -> tuple[dict[str, Callable], nn.Module]:
    """The timed paths of variant ``name`` (fp16, channels-last) and the fp32 fused reference."""
    model = randomize_(create_model(name, img_size=size), seed=0).eval()
    reference = fuse(model).cuda()
    fast = kernels.load()

    def half(m: nn.Module) -> nn.Module:
        return copy.deepcopy(m).cuda().half().to(memory_format=torch.channels_last).eval()

    triton_model = half(fast.swap_triton_modules(fuse(model)))
    out = {
        ANCHOR: compiled(half(timm_port(model, name, (size, size))), example),
        "cgavit fuse, compile": compiled(half(fuse(model)), example),
        "cgavit triton, compile": compiled(triton_model, example),
        "cgavit triton, eager": triton_model,
    }
    return out, reference


def measure(name: str, args: argparse.Namespace) -> list[dict]:
    """One table row per path of variant ``name``."""
    def batch(n: int) -> torch.Tensor:
        x = torch.randn(n, 3, args.size, args.size, device="cuda", dtype=torch.float16)
        return x.contiguous(memory_format=torch.channels_last)

    calls, reference = paths(name, args.size, batch(max(args.latency_batches)))
    rows = {label: {"model": name, "path": label, "ms": {}} for label in calls}
    check = batch(8)
    with torch.no_grad():
        expected = reference(check.float())
        for label, fn in calls.items():
            rows[label]["rel_err_fp32"] = rel_err(fn(check).float(), expected)
        for n in dict.fromkeys((args.batch, *args.latency_batches)):  # a batch that is both is timed once
            x = batch(n)
            bound = {label: (lambda fn=fn: fn(x)) for label, fn in calls.items()}
            record(rows, n, round_robin(bound, args.warmup, args.repeats, device="cuda"), args)
    anchor = rows[ANCHOR]["img_s"]
    for row in rows.values():
        row["ratio"] = row["img_s"] / anchor
    return list(rows.values())


def record(rows: dict[str, dict], n: int, timings: dict[str, Timings], args: argparse.Namespace) -> None:
    """Batch ``n``'s timings into each path's row: images/s (``img_s``) at the throughput batch, ms per batch
    (``ms[n]``) at a latency batch, both where ``n`` is both (``--batch 64`` with 64 among the latency batches)."""
    for label, t in timings.items():
        if n == args.batch:
            rows[label]["img_s"] = t.median_rate(n)
        if n in args.latency_batches:
            rows[label]["ms"][n] = 1e3 * statistics.median(t.seconds)


def table(rows: list[dict], args: argparse.Namespace) -> str:
    """The rows as a Markdown table."""
    head = f"| model | path | img/s @{args.batch} | x anchor | " + " | ".join(
        f"ms @{n}" for n in args.latency_batches) + " | rel err vs fp32 |"
    lines = [head, "|" + "---|" * (5 + len(args.latency_batches))]
    for r in rows:
        lat = " | ".join(f"{r['ms'][n]:.2f}" for n in args.latency_batches)
        lines.append(
            f"| {r['model']} | {r['path']} | {r['img_s']:,.0f} | {r['ratio']:.2f} | {lat} "
            f"| {r['rel_err_fp32']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", type=variant_name, default=["efficientvit_m0", "efficientvit_m4"])
    parser.add_argument("--size", type=image_side, default=224)
    parser.add_argument("--batch", type=whole_number(1), default=2048, help="throughput batch")
    parser.add_argument("--latency-batches", type=whole_number(1), nargs="+", default=[1, 8, 64])
    parser.add_argument("--warmup", type=whole_number(0), default=5)
    parser.add_argument("--repeats", type=whole_number(1), default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs a CUDA GPU")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [row for name in args.models for row in measure(name, args)]
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, fp16 channels-last, {args.size} px\n")
    print(table(rows, args))


if __name__ == "__main__":
    main()
