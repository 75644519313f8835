"""The sensitive layers' activation ranges searched for fidelity to fp32: does a better range keep them int8?

On the CIFAR-10 references the layers int8 must leave in float (the stem's, the patch merges') are where int8
pays most on AVX2. Their weights' and activations' precision both matter (``int8_where_lost.py``); this
script asks whether the activations' *ranges* are what costs the decisions: NNCF sets each quantiser's range
from calibration statistics (percentiles), which clips rare large values. Starting from cgavit's
every-layer-int8 OpenVINO build with ``patch_embed.conv1`` float (it costs nothing there), each quantiser in
front of a stem or patch-merge convolution in turn has its range scaled by every factor of ``--factors``
(1: NNCF's), keeping the factor that brings the int8 logits closest to fp32's on ``--tune`` training images
(mean squared error, or the KL divergence of the softmax with ``--objective kl``). The build is judged top-1
against the fused fp32 model on DIR/VAL, images no step of the search saw, before and after.

Usage::

    python benchmarks/int8_ranges.py --checkpoint runs/c10-5k-m0-96/best.safetensors --data cifar10-5k --val-split test
"""

from __future__ import annotations

import time

import numpy as np
import openvino as ov
import torch

from cgavit.bench import load_labelled
from cgavit.cli.types import whole_number
from cgavit.deploy import compare_logits, cpu_features
from cgavit.deploy.openvino import OpenVinoModule
from cgavit.deploy.sensitivity import padded_logits
from int8_where_lost import int8_base, reference_arguments  # this folder's base build (run as python benchmarks/int8_ranges.py)

OPS = ov.opset13


def sensitive_quantisers(model, layers: dict[str, str], skip: list[str]) -> list[str]:
    """The ``FakeQuantize`` nodes in front of the stem's and the patch merges' convolutions (not ``skip``), in
    graph order, each once."""
    ops = {op.get_friendly_name(): op for op in model.get_ordered_ops()}
    found: dict[str, None] = {}
    for name, node in layers.items():
        if name in skip or not (name.startswith("patch_embed.") or ".downsample.patchmerge." in name):
            continue
        source = ops[node].input_value(0).get_node()
        if source.get_type_name() == "FakeQuantize":
            found[source.get_friendly_name()] = None
    return list(found)


def scaled_ranges(model, factors: dict[str, float]):
    """A copy of ``model`` whose named quantisers have their input and output ranges multiplied by a factor each."""
    out = model.clone()
    ops = {op.get_friendly_name(): op for op in out.get_ordered_ops()}
    for name, factor in factors.items():
        if factor == 1.0:
            continue
        fq = ops[name]
        for i in range(1, 5):  # input low/high, output low/high
            bound = fq.input_value(i).get_node().get_data().astype(np.float32) * factor
            fq.input(i).replace_source_output(OPS.constant(bound).output(0))
    out.validate_nodes_and_infer_types()
    return out


def distance(logits: torch.Tensor, reference: torch.Tensor, objective: str) -> float:
    """How far int8 logits are from fp32's: mean squared error, or the mean KL divergence of their softmax."""
    if objective == "kl":
        p, q = torch.log_softmax(reference, 1), torch.log_softmax(logits, 1)
        return float((p.exp() * (p - q)).sum(1).mean())
    return float(((logits - reference) ** 2).mean())


def main() -> None:
    p = reference_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--tune", type=whole_number(1), default=512,
                   help="training images the search judges ranges on (default 512)")
    p.add_argument("--factors", default="0.85,1,1.15,1.3,1.5,1.75,2",
                   help="range factors tried for each quantiser, comma-separated (default 0.85,1,1.15,1.3,1.5,1.75,2)")
    p.add_argument("--objective", choices=("mse", "kl"), default="mse", help="distance to fp32's logits (default mse)")
    args = p.parse_args()
    info, fused, ev, reference, builder, base = int8_base(args)
    tune = load_labelled(args.data, "train", info, args.tune, seed=7).images
    tune_reference = padded_logits(fused, tune)
    factors = dict.fromkeys(sensitive_quantisers(base, builder.layers, ["patch_embed.conv1"]), 1.0)

    def judge(m, label: str) -> None:
        a = compare_logits(padded_logits(OpenVinoModule(m, 1, "int8"), ev.images), reference, ev.labels)
        print(f"| {label} | {100 * a.top1_agreement:.2f} % ({a.changed}) | {a.accuracy_change:+.2f} |", flush=True)

    def cost(f: dict[str, float]) -> float:
        return distance(padded_logits(OpenVinoModule(scaled_ranges(base, f), 1, "int8"), tune), tune_reference,
                        args.objective)

    print(f"{args.checkpoint}: {len(ev.images)} images judged, {len(tune)} tuned on; {cpu_features().describe()}\n")
    best, start = cost(factors), time.time()
    for name in factors:
        for factor in (float(x) for x in args.factors.split(",")):
            trial = dict(factors, **{name: factor})
            value = cost(trial)
            if value < best:
                best, factors = value, trial
        print(f"{name}: x{factors[name]:g}, {args.objective} {best:.5f} ({time.time() - start:.0f} s)", flush=True)
    print("\n| build | top-1 agreement (changed) | accuracy change |\n|---|---:|---:|")
    judge(builder.build([]), "every layer int8")
    judge(base, "`patch_embed.conv1` float, NNCF's ranges")
    judge(scaled_ranges(base, factors), f"the same, the searched ranges ({args.objective})")


if __name__ == "__main__":
    main()
