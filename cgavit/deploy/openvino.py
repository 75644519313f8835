"""OpenVINO (Intel CPUs): conversion from PyTorch, the OpenVINO runtime as a module, int8 through NNCF.

The ``cgavit[openvino]`` extra (``openvino``, ``nncf``). Each is imported in one place, on first use:
OpenVINO in :func:`_openvino`, NNCF in :func:`_nncf`. Conversion goes straight from the fused PyTorch
model (``openvino.convert_model``), batch dynamic, image size fixed (as for ONNX).

On a CPU with native bf16 OpenVINO *computes in bf16 by default*; this module always asks for the
precision it was given (``INFERENCE_PRECISION_HINT``): ``f32`` for fp32, ``bf16`` for bf16, and for int8
the precision of the build's float part (what NNCF leaves unquantised; fp32 unless the build was judged
with a bf16 one; a ``bf16-layers`` build compiles in fp32 with its bf16 convolutions typed in the graph;
:mod:`cgavit.deploy.int8`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import threading
import warnings
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from xml.etree import ElementTree

import torch
from torch import nn

from ..io import check_readable_file, replace_together, staging, stop_signals_deferred, write_error
from ..schema import bounded_json
from .cpu import ISA_CAP_VARIABLES, CpuFeatures, cpu_features
from .first_layer import gptq_convolution
from .fusion import example_batch, export_form, named_output
from .int8 import FLOAT_PARTS, Int8Options, compile_precision, layer_of_openvino_node
from .metadata import KEYS, PREFIX, ExportInfo, export_info, int8_info, unreadable_file
from .runtime import RuntimeModule, import_problem, quiet_quantiser

#: OpenVINO's name of each precision this module offers (its ``INFERENCE_PRECISION_HINT``).
PRECISION_HINT = {"fp32": "f32", "int8": "f32", "bf16": "bf16"}


def _openvino() -> ModuleType:
    """The one place OpenVINO is imported (optional extra; about a second to import)."""
    import openvino

    return openvino


def _nncf() -> ModuleType:
    """The one place NNCF (OpenVINO's quantiser) is imported."""
    import nncf

    return nncf


class _SignalStack(ctypes.Structure):
    """C's ``stack_t`` (Linux): a thread's alternate signal stack."""

    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


_SS_DISABLE = 2  # stack_t.ss_flags: no alternate stack


@functools.cache
def _libc():
    """The C library, for ``sigaltstack`` (None off Linux, where OpenVINO's CPU plugin leaves it alone)."""
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def signal_stack() -> tuple[int | None, int] | None:
    """The calling thread's alternate signal stack as ``(address, size)`` (``(None, 0)``: none is set), or None
    where it cannot be read (not Linux)."""
    libc, now = _libc(), _SignalStack()
    if libc is None or libc.sigaltstack(None, ctypes.byref(now)) != 0:
        return None
    return (None, 0) if now.ss_flags & _SS_DISABLE else (now.ss_sp, now.ss_size)


@contextlib.contextmanager
def kept_signal_stack():
    """Give the calling thread back the alternate signal stack it had before the block.

    OpenVINO's CPU plugin (2026.4.1; Linux) maps an alternate signal stack for the thread that creates it and
    unmaps it when the plugin goes, putting back the stack it found only if its own is still the thread's.
    Two plugins that go in the order they came (or one that goes on another thread) leave the thread with an
    unmapped stack; the next signal that runs a Python handler there (``SIGCHLD`` from a DataLoader's
    workers, ``SIGINT``: Python's handlers ask for the alternate stack) is then written over whatever holds
    that memory now, and the process dies of a segmentation fault, often much later and far away. With the
    thread's own stack back after each block that can create a plugin, no thread holds a plugin's stack, and
    a plugin that goes unmaps memory no one uses.
    """
    before = signal_stack()
    try:
        yield
    finally:
        if before is not None and signal_stack() != before:
            address, size = before
            libc = _libc()
            if libc.sigaltstack(ctypes.byref(_SignalStack(address, 0 if address else _SS_DISABLE, size)), None) != 0:
                # refused (with AMX enabled since, the kernel refuses a stack too small for its frames): none
                # at all is still safer than a plugin's, which goes with the plugin
                libc.sigaltstack(ctypes.byref(_SignalStack(None, _SS_DISABLE, 0)), None)


@functools.cache
def _core():
    """The process's one ``openvino.Core``: its CPU plugin is made once and lives as long as the process
    (each Core makes its own, with an alternate signal stack; see :func:`kept_signal_stack`).

    It reads a ``.bin`` into memory rather than mapping it: a mapped file rewritten after it was opened
    (``cp other.bin m.bin``) changed a model's logits without a word, and cut short, killed the process
    with SIGBUS at its next call."""
    with kept_signal_stack():
        core = _openvino().Core()
    core.set_property({"ENABLE_MMAP": False})
    return core


def compile_cpu(model, config: dict):
    """``model`` (an ``openvino.Model``) compiled for the CPU with ``config``, by the process's one Core,
    leaving the calling thread's signal stack as it was (:func:`kept_signal_stack`)."""
    with kept_signal_stack():
        return _core().compile_model(model, "CPU", config)


def openvino_available() -> bool:
    """Whether OpenVINO is installed and imports (:func:`~cgavit.deploy.runtime.import_problem`), and NNCF, its
    quantiser, is installed (not imported here: it takes seconds, and only int8 needs it)."""
    return openvino_problem() is None


def openvino_problem(int8: bool = True) -> str | None:
    """Why the OpenVINO paths (``int8=False``: its fp32 and bf16 ones, which need no NNCF) cannot be used here, or
    None."""
    nncf = None if not int8 or importlib.util.find_spec("nncf") else "nncf is not installed"
    return import_problem("openvino") or nncf


def convert_openvino(model: nn.Module, img_size: tuple[int, int], fold_residuals: bool = True):
    """``model``'s inference form (:func:`~cgavit.deploy.fusion.export_form`) as an OpenVINO model
    (``openvino.Model``), batch dynamic, image size fixed.

    A Ctrl-C or SIGTERM during the conversion (seconds) takes effect when it is done: the converter calls back into
    Python, and an interrupt raised there came out as its own conversion error (a traceback), or not at all."""
    ov = _openvino()
    fused = export_form(model, img_size, fold_residuals)
    x = example_batch(fused, img_size)
    with torch.no_grad(), warnings.catch_warnings(), stop_signals_deferred():
        warnings.simplefilter("ignore")  # tracer notices about shape-dependent branches: the size is fixed
        return ov.convert_model(fused, example_input=x, input=[(-1, x.shape[1], *img_size)])


def openvino_from_onnx(path: str | os.PathLike):
    """An ONNX file (fp32, or int8 with ``QuantizeLinear``/``DequantizeLinear``, which OpenVINO runs in
    int8) as an ``openvino.Model``."""
    return _openvino().convert_model(str(path))


class OpenVinoInt8Builder:
    """int8 versions of one model for OpenVINO (NNCF), with any of its layers kept in float.

    The model is converted once and quantised once, every convolution int8 (one NNCF run, about 85 s
    for M0 at 96 px on 256 images on a 2-core AVX2 EPYC, most of it the full bias correction); a build
    with layers kept in float is that model with their quantisers taken out again
    (:func:`restore_float_layers`), a graph edit of a second or two. Asking NNCF itself to leave them out
    (its ignored scope) costs one NNCF run per build and decides about as well: on the CIFAR-10
    references, with 1 to 16 float layers, the two differed by 0 to 9 decisions of 2,000, NNCF's more
    often ahead, since its bias correction then sees those layers float (BENCHMARKS.md); what the
    edit buys is a sensitivity measured in OpenVINO itself. The recipe: the ``MIXED`` preset (symmetric
    per-channel weights, asymmetric activations), the full bias correction (on the digits model the
    fast one kept 99.4 % of decisions, the full one 99.7 %), 7-bit weights on x86 without VNNI
    (``OverflowFix.ENABLE``, see :mod:`cgavit.deploy.int8`), and with ``attention_float`` the
    transformer model type with every matmul ignored: the attention core (score and PV matmuls,
    softmax) and the residual adds stay float. The first convolution's weights are then rounded again with GPTQ
    (:func:`gptq_first_layer`; ``options.gptq_first_layer``).

    Args:
        model: the model (its export form is converted).
        img_size: ``(H, W)``.
        calibration: image batches preprocessed like the model's input (training images).
        options: the choices (``reduce_range`` must be decided: :meth:`Int8Options.for_cpu`).

    Raises:
        ValueError: no calibration image, or ``reduce_range`` left undecided.
    """

    def __init__(self, model: nn.Module, img_size: tuple[int, int], calibration: Iterable[torch.Tensor],
                 options: Int8Options) -> None:
        self.batches = [b.float().numpy() for b in calibration]
        if not self.batches:
            raise ValueError("int8 calibration needs at least one image batch")
        if options.reduce_range is None:
            raise ValueError("decide reduce_range first: options.for_cpu(cpu_features())")
        self.options = options
        self.float_model = convert_openvino(model, img_size, fold_residuals=False)
        #: layer name -> its convolution node's name, in graph order
        self.layers = convolution_nodes(self.float_model)
        #: the every-layer-int8 model (NNCF's, made on the first build)
        self.every_int8 = None
        #: the layer of the first convolution, whose weights GPTQ rounds (None: NNCF's rounding for every layer; after
        #: the first build, None also where NNCF's graph gave that layer no form GPTQ rounds: :func:`gptq_first_layer`)
        self.gptq_layer = first_convolution(self.float_model) if options.gptq_first_layer else None

    def build(self, float_layers: Iterable[str] = (), float_part: str = "fp32"):
        """The int8 ``openvino.Model`` with ``float_layers`` kept in float (a new model each call); with the float
        part ``"bf16-layers"`` they are bf16 convolutions (:func:`bf16_convolutions`), else fp32 ones.

        Raises:
            ValueError: a layer name the model does not have.
        """
        keep = list(float_layers)
        unknown = [name for name in keep if name not in self.layers]
        if unknown:
            raise ValueError(f"no such layer in the converted model: {', '.join(unknown)}")
        if self.every_int8 is None:
            self.every_int8 = self.quantize()
        nodes = [self.layers[name] for name in keep]
        model = restore_float_layers(self.every_int8, self.float_model, nodes)
        return bf16_convolutions(model, nodes) if float_part == "bf16-layers" else model

    def quantize(self):
        """Every convolution int8: one NNCF run."""
        nncf, opts = _nncf(), self.options
        advanced = nncf.AdvancedQuantizationParameters(
            overflow_fix=nncf.OverflowFix.ENABLE if opts.reduce_range else nncf.OverflowFix.DISABLE,
            disable_bias_correction=opts.bias_correction == "none",
            activations_range_estimator_params=_range_estimator(nncf, opts.calibration),
        )
        ignored = nncf.IgnoredScope(types=["MatMul"] if opts.attention_float else [], validate=False)
        with warnings.catch_warnings(), kept_signal_stack(), quiet_quantiser("NNCF"):  # NNCF compiles with Cores of its own
            warnings.simplefilter("ignore")
            model = nncf.quantize(
                self.float_model.clone(), nncf.Dataset(self.batches), subset_size=len(self.batches),
                preset=nncf.QuantizationPreset.MIXED, fast_bias_correction=opts.bias_correction == "fast",
                model_type=nncf.ModelType.TRANSFORMER if opts.attention_float else None,
                ignored_scope=ignored, advanced_parameters=advanced,
            )
        if self.gptq_layer is not None and not gptq_first_layer(
                model, self.float_model, self.layers[self.gptq_layer], [torch.from_numpy(b) for b in self.batches],
                half=63 if opts.reduce_range else 127):
            self.gptq_layer = None
        return model


def convolution_nodes(model) -> dict[str, str]:
    """Each layer (the qualified name of its ``nn.Conv2d``) of a converted model -> its convolution node's name, in
    graph order."""
    layers = {}
    for op in model.get_ordered_ops():
        layer = layer_of_openvino_node(op.get_friendly_name())
        if layer is not None and op.get_type_name() in ("Convolution", "GroupConvolution"):
            layers[layer] = op.get_friendly_name()
    return layers


def first_convolution(model) -> str | None:
    """The layer of the convolution that reads ``model``'s (a float model's) input directly, or None."""
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Convolution" and op.input_value(0).get_node().get_type_name() == "Parameter":
            return layer_of_openvino_node(op.get_friendly_name())
    return None


def gptq_first_layer(int8_model, float_model, node: str, batches: list[torch.Tensor], half: int = 127) -> bool:
    """Change NNCF's ``int8_model`` in place: the int8 weights of the convolution ``node`` rounded again by GPTQ for
    the calibration ``batches`` (:mod:`cgavit.deploy.first_layer`; ``half`` steps a side) and its bias set so that
    its mean output on them, through NNCF's input quantiser, is fp32's. The graph keeps its form
    (int8 weights, their steps, the bias ``Add``), so :func:`restore_float_layers` puts fp32 back as before. A node
    NNCF did not quantise as expected (its input through one per-tensor quantiser, a bias after it), or a dilated
    one, is left as it is.

    Returns:
        Whether the weights were rounded again (False: the model is unchanged).
    """
    ops, opset = {op.get_friendly_name(): op for op in int8_model.get_ordered_ops()}, _openvino().opset13
    conv, original = ops[node], {op.get_friendly_name(): op for op in float_model.get_ordered_ops()}[node]
    quantiser, bias, here = conv.input_value(0).get_node(), _bias_input(original), _bias_input(conv)
    if quantiser.get_type_name() != "FakeQuantize" or bias is None or here is None or set(conv.get_dilations()) != {1}:
        return False
    ranges = [quantiser.input_value(i).get_node().get_data() for i in range(1, 5)]  # input low, high; output low, high
    if any(r.size != 1 for r in ranges):
        return False
    low, high, out_low, out_high = (float(r.reshape(-1)[0]) for r in ranges)
    if (low, high) != (out_low, out_high):
        return False
    levels = quantiser.get_levels()
    step = (high - low) / (levels - 1)
    begin, end = list(conv.get_pads_begin()), list(conv.get_pads_end())
    layer = gptq_convolution(
        torch.from_numpy(_folded_weights(original)),
        torch.from_numpy(bias[0].input_value(bias[1]).get_node().get_data().reshape(-1).copy()), batches,
        lambda x: torch.clamp(torch.round((x - low) / step), 0, levels - 1) * step + low,
        list(conv.get_strides()), (*begin, *end), half)
    weights = opset.multiply(opset.convert(opset.constant(layer.weights.numpy()), "f32"),
                             opset.constant(layer.scale.numpy().reshape(-1, 1, 1, 1)))
    conv.input(1).replace_source_output(weights.output(0))
    shape = here[0].input_value(here[1]).get_shape()
    here[0].input(here[1]).replace_source_output(opset.constant(layer.bias.numpy().reshape(list(shape))).output(0))
    int8_model.validate_nodes_and_infer_types()
    return True


def _bias_input(conv) -> tuple[object, int] | None:
    """The ``Add`` that adds a convolution node's bias (a constant) to its output, and which of its inputs the
    constant is; None where the convolution has none."""
    for reader in conv.output(0).get_target_inputs():
        add = reader.get_node()
        if add.get_type_name() != "Add":
            continue
        for i in range(2):
            if add.input_value(i).get_node().get_type_name() == "Constant":
                return add, i
    return None


def restore_float_layers(int8_model, float_model, convolutions: Iterable[str]):
    """A copy of NNCF's ``int8_model`` in which the named convolution nodes run in float again: each reads
    its input without the quantiser in front of it (other readers of that input keep theirs), and gets
    back its fp32 weights and bias from ``float_model`` (the model NNCF quantised, before quantisation;
    the bias also undoes NNCF's bias correction of that layer).

    Raises:
        ValueError: a node missing from either model, or weights that are not a constant in ``float_model``.
    """
    names = list(convolutions)
    out = int8_model.clone()
    if not names:
        return out
    ops = {op.get_friendly_name(): op for op in out.get_ordered_ops()}
    plain = {op.get_friendly_name(): op for op in float_model.get_ordered_ops()}
    missing = [name for name in names if name not in ops or name not in plain]
    if missing:
        raise ValueError(f"no such convolution in both models: {', '.join(missing)}")
    constant = _openvino().opset13.constant
    for name in names:
        conv, original = ops[name], plain[name]
        source = conv.input_value(0).get_node()
        if source.get_type_name() == "FakeQuantize":
            conv.input(0).replace_source_output(source.input_value(0))
        conv.input(1).replace_source_output(constant(_folded_weights(original)).output(0))
        here, twin = _bias_input(conv), _bias_input(original)
        if here is not None and twin is not None:
            here[0].input(here[1]).replace_source_output(constant(twin[0].input_value(twin[1]).get_node().get_data()).output(0))
    out.validate_nodes_and_infer_types()
    return out


def bf16_convolutions(model, convolutions: Iterable[str]):
    """``model`` (changed in place, and returned) with the named float convolution nodes computing in bf16:
    each reads its input and weights through a conversion to bf16 and its readers get its output converted
    back to fp32. OpenVINO compiled in fp32 keeps these bf16 (a CPU with native bf16 runs them so), and the rest
    of the float part in fp32.

    Raises:
        ValueError: a node that is not a convolution of ``model``.
    """
    ov, names = _openvino(), list(convolutions)
    ops = {op.get_friendly_name(): op for op in model.get_ordered_ops()}
    wrong = [n for n in names if n not in ops or ops[n].get_type_name() not in ("Convolution", "GroupConvolution")]
    if wrong:
        raise ValueError(f"no such convolution in the model: {', '.join(wrong)}")
    opset = ov.opset13
    for name in names:
        conv = ops[name]
        make = opset.group_convolution if conv.get_type_name() == "GroupConvolution" else opset.convolution
        bf16 = make(opset.convert(conv.input_value(0), "bf16"), opset.convert(conv.input_value(1), "bf16"),
                    strides=list(conv.get_strides()), pads_begin=list(conv.get_pads_begin()),
                    pads_end=list(conv.get_pads_end()), dilations=list(conv.get_dilations()))
        bf16.set_friendly_name(name)  # the layer keeps its name (profiles, reports)
        conv.set_friendly_name(f"{name}/fp32")
        back = opset.convert(bf16, "f32")
        for reader in list(conv.output(0).get_target_inputs()):
            reader.replace_source_output(back.output(0))
    model.validate_nodes_and_infer_types()
    return model


def _folded_weights(conv):
    """A float convolution node's weights as an array of the shape it reads (a constant, or a reshaped one,
    as OpenVINO converts grouped convolutions)."""
    node = conv.input_value(1).get_node()
    if node.get_type_name() == "Reshape":
        node = node.input_value(0).get_node()
    if node.get_type_name() != "Constant":
        raise ValueError(f"{conv.get_friendly_name()}: weights are a {node.get_type_name()}, not a constant")
    return node.get_data().astype("float32").reshape(list(conv.get_input_shape(1)))


def openvino_conv_times(
    model, example: torch.Tensor, layers: Iterable[str], threads: int = 1, runs: int = 5,
) -> dict[str, float]:
    """Milliseconds each convolution layer takes per call of ``example`` in OpenVINO, from its per-node
    performance counters (the median of ``runs`` calls after one untimed), for an fp32 or int8 ``openvino.Model``.

    Args:
        model: the model (compiled here for the example's batch).
        example: an input batch.
        layers: the layer names to look for (:attr:`OpenVinoInt8Builder.layers`); others are ignored.
        threads, runs: inference threads, and timed calls.
    """
    wanted = set(layers)
    static = model.clone()
    static.reshape(list(example.shape))
    compiled = compile_cpu(static, {
        "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "PERF_COUNT": True,
        "INFERENCE_PRECISION_HINT": PRECISION_HINT["fp32"]})
    request = compiled.create_infer_request()
    x = example.detach().float().contiguous().numpy()
    calls: dict[str, list[float]] = defaultdict(list)
    for i in range(runs + 1):
        request.infer({0: x})
        if i == 0:
            continue
        for counter in request.get_profiling_info():
            layer = layer_of_openvino_node(counter.node_name)
            if layer in wanted:
                calls[layer].append(counter.real_time.total_seconds() * 1000.0)
    return {layer: statistics.median(times) for layer, times in calls.items()}


def _range_estimator(nncf: ModuleType, method: str):
    """NNCF's activation range estimator for a calibration method: its default (min/max statistics),
    the mean of per-batch quantiles, or its histogram search."""
    sets = nncf.quantization.range_estimator.RangeEstimatorParametersSet
    if method == "percentile":
        return sets.MEAN_QUANTILE
    if method == "entropy":
        return sets.HISTOGRAM
    return nncf.quantization.range_estimator.RangeEstimatorParameters()


def export_openvino(
    model: nn.Module,
    path: str | os.PathLike,
    img_size: tuple[int, int] = (224, 224),
    precision: str = "fp32",
    calibration: Iterable[torch.Tensor] | None = None,
    options: Int8Options | None = None,
    info: ExportInfo | None = None,
) -> Path:
    """Write ``model``'s inference form as OpenVINO IR: ``NAME.xml`` (the graph) and ``NAME.bin`` beside it.

    Args:
        model: the model (fused here).
        path: ``NAME.xml``, or ``NAME`` alone (``.xml`` is added).
        img_size: ``(H, W)`` the model will accept; the batch is dynamic.
        precision: ``"fp32"`` or ``"int8"`` (NNCF, calibrated on ``calibration``).
        calibration: int8 only: image batches, e.g. a few hundred training images.
        options: int8 only: how to quantise (default :class:`~cgavit.deploy.int8.Int8Options`, for this CPU).
        info: metadata for the model's ``rt_info`` (default: the image size alone).

    Returns:
        The ``.xml`` path written.

    Raises:
        ValueError: unknown precision, int8 without calibration, a missing output folder, a path
            naming another format.
    """
    path = ir_path(path)
    if precision not in PRECISION_HINT:
        raise ValueError(f"OpenVINO precision must be one of {', '.join(PRECISION_HINT)}, got {precision!r}")
    info = export_info(info, img_size, getattr(model, "in_chans", 3))
    if precision == "int8":
        if calibration is None:
            raise ValueError("int8 needs calibration images: give a few hundred training images (--data DIR)")
        opts = (options or Int8Options()).for_cpu(cpu_features())
        ov_model = OpenVinoInt8Builder(model, img_size, calibration, opts).build(opts.float_layers)
        info = int8_info(info, opts)
    else:
        ov_model = convert_openvino(model, img_size)
    save_openvino(ov_model, path, info)
    return path


def ir_path(path: str | os.PathLike) -> Path:
    """Where OpenVINO IR named ``path`` goes: ``NAME.xml`` as given, ``NAME`` -> ``NAME.xml``.

    Raises:
        ValueError: see :func:`~cgavit.deploy.fusion.named_output`; ``NAME.bin`` is a folder.
    """
    path = named_output(path, ".xml", "OpenVINO IR (NAME.xml + NAME.bin)")
    if path.with_suffix(".bin").is_dir():
        raise ValueError(f"cannot write {path.with_suffix('.bin')}: it is a folder (nothing was written); give "
                         "another name")
    return path


def save_openvino(ov_model, path: Path, info: ExportInfo) -> None:
    """Write ``ov_model`` with ``info`` in its ``rt_info`` to ``path`` (``.xml``) and its ``.bin``.

    Weights are kept in fp32 (OpenVINO's default would store them in fp16). Both files are written beside
    the destination and moved into place together (:func:`~cgavit.io.replace_together`), so a reader never finds
    an ``.xml`` with another file's weights, even after a Ctrl-C.

    Raises:
        WriteError: the files could not be written (a full disk, permissions; the old pair is kept).
    """
    with staging(path) as tmp:
        xml = write_openvino(ov_model, tmp / path.name, info)
        replace_together([(xml.with_suffix(".bin"), path.with_suffix(".bin")), (xml, path)])


def write_openvino(ov_model, path: Path, info: ExportInfo) -> Path:
    """Write ``ov_model`` with ``info`` in its ``rt_info`` to ``path`` (``.xml``) and its ``.bin``, in place (a
    temporary folder's: :func:`save_openvino` moves them); returns ``path``.

    Raises:
        WriteError: the files could not be written (a full disk, permissions).
    """
    ov = _openvino()
    for key, value in info.to_props().items():
        ov_model.set_rt_info(value, key.split(".", 1))
    try:
        ov.save_model(ov_model, str(path), compress_to_fp16=False)
        # written again with the .bin's size and digest in the .xml (read_openvino checks them); the .bin is the same
        ov_model.set_rt_info(json.dumps(weights_record(path.with_suffix(".bin"))), [PREFIX, WEIGHTS_KEY])
        ov.save_model(ov_model, str(path), compress_to_fp16=False)
    except (OSError, RuntimeError) as err:  # OpenVINO reports a full disk as a RuntimeError
        raise write_error(path, err) from None
    return path


#: The ``rt_info`` key, beside the metadata's under ``cgavit``, of the ``.bin`` an ``.xml`` was written with.
WEIGHTS_KEY = "weights"


def weights_record(path: Path) -> dict:
    """The size and SHA-256 of a ``.bin`` (``{"bytes": n, "sha256": hex}``): what an ``.xml`` records of its weights."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):  # hashlib.file_digest is Python 3.11's
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def check_weights(ov_model, path: Path) -> None:
    """Refuse a ``.bin`` beside the ``.xml`` at ``path`` other than the one it was written with (another export's
    weights, or ones cut short or lengthened): its size and SHA-256 against the ``.xml``'s record
    (:func:`weights_record`). An ``.xml`` that records none, written before cgavit recorded it, is not checked.

    Raises:
        ValueError: a record that is malformed or that the ``.bin`` does not match, in one line.
    """
    try:
        if not ov_model.has_rt_info([PREFIX, WEIGHTS_KEY]):
            return
        text = ov_model.get_rt_info([PREFIX, WEIGHTS_KEY]).astype(str)
    except RuntimeError:  # a 'cgavit' entry that is no section of keys: openvino_metadata refuses it
        return
    recorded = _parsed_record(text)
    if recorded is None:
        raise ValueError(f"{path}: its record of its weights (rt_info '{PREFIX}' '{WEIGHTS_KEY}') is malformed; export "
                         "it again")
    _match_weights(recorded, path)


def _parsed_record(text: str) -> dict | None:
    """A weights record (:func:`weights_record`) read from its JSON text, or None where it is malformed."""
    try:
        recorded = bounded_json(text, f"{PREFIX}.{WEIGHTS_KEY}")
    except ValueError:  # too long, too deep, not JSON
        return None
    ok = isinstance(recorded, dict) and type(recorded.get("bytes")) is int and isinstance(recorded.get("sha256"), str)
    return recorded if ok else None


def _match_weights(recorded: dict, path: Path) -> None:
    """Refuse the ``.bin`` beside the ``.xml`` at ``path`` where it is not the one ``recorded`` (size and SHA-256)."""
    weights = path.with_suffix(".bin")
    found = weights_record(weights)
    if found["bytes"] != recorded["bytes"] or found["sha256"] != recorded["sha256"]:
        how = (f"{found['bytes']:,} bytes where it records {recorded['bytes']:,}" if found["bytes"] != recorded["bytes"]
               else "another SHA-256 digest than it records")
        raise ValueError(f"{weights} is not the .bin {path.name} was written with ({how}): put the .bin exported with "
                         "it beside it, or export it again")


def _text_weights_record(path: Path) -> dict | None:
    """The weights record of the ``.xml`` at ``path``, read from its XML text, for an ``.xml`` that OpenVINO could not
    read with the ``.bin`` beside it: another export's ``.bin`` (of another size) failed as 'truncated or corrupt?'
    with OpenVINO's reason ('Output pattern dim[0] has invalid bounds'), never naming the ``.bin``. None where the
    text cannot be parsed or records none."""
    try:
        found = ElementTree.parse(path).getroot().find(f"rt_info/{PREFIX}/{WEIGHTS_KEY}")
    except (ElementTree.ParseError, OSError):  # a cut-short .xml: OpenVINO's own error says it
        return None
    return None if found is None else _parsed_record(found.get("value", ""))


def openvino_metadata(ov_model, source: str = "the OpenVINO model") -> dict[str, str]:
    """The cgavit keys of an OpenVINO model's ``rt_info`` (``{"cgavit.KEY": json text}``).

    Raises:
        ValueError: an ``rt_info`` whose ``cgavit`` entry is not a section of keys (OpenVINO cannot look into it).
    """
    props = {}
    for key in KEYS:
        try:
            if ov_model.has_rt_info([PREFIX, key]):
                props[f"{PREFIX}.{key}"] = ov_model.get_rt_info([PREFIX, key]).astype(str)
        except RuntimeError:
            raise ValueError(f"{source}: its cgavit metadata (rt_info '{PREFIX}') is not a section of keys; export it "
                             "again") from None
    return props


def openvino_model(
    model: nn.Module, img_size: tuple[int, int], precision: str = "fp32",
    calibration: Iterable[torch.Tensor] | None = None,
):
    """The OpenVINO model of ``model`` in ``precision`` (``"fp32"``, ``"bf16"``: the same graph, or
    ``"int8"``: quantised for this CPU with the default :class:`~cgavit.deploy.int8.Int8Options`).

    Raises:
        ValueError: unknown precision, or int8 without calibration.
    """
    if precision not in PRECISION_HINT:
        raise ValueError(f"OpenVINO precision must be one of {', '.join(PRECISION_HINT)}, got {precision!r}")
    if precision == "int8" and calibration is None:
        raise ValueError("int8 needs calibration images: give a few hundred training images (--data DIR)")
    if precision != "int8":
        return convert_openvino(model, img_size, fold_residuals=precision == "fp32")
    return OpenVinoInt8Builder(model, img_size, calibration, Int8Options().for_cpu(cpu_features())).build()


def capped_bf16_error(features: CpuFeatures) -> str | None:
    """Why OpenVINO cannot compile in bf16 here, or None: the CPU has bf16 and oneDNN's ISA cap hides it, so
    OpenVINO, which picks bf16 by the CPU, finds no bf16 kernels (it failed to compile a Softmax so)."""
    hidden = sorted({"avx512_bf16", "amx_bf16"} & features.hidden)
    if not hidden:
        return None
    return (f"OpenVINO cannot compute in bf16 here: oneDNN's ISA cap {features.isa_cap.upper()} hides this CPU's "
            f"{', '.join(hidden)} from its kernels; unset {' and '.join(ISA_CAP_VARIABLES)}, or use fp32")


class OpenVinoModule(RuntimeModule):
    """An OpenVINO model (an ``.xml`` file or an ``openvino.Model``) compiled for the CPU, called like a module.

    The model is compiled once per batch size seen, with that batch fixed: with the batch left dynamic,
    an NNCF int8 model crashed the process (segmentation fault) at batches below 8 on an AMX CPU with
    OpenVINO 2026.4.1, and ran at the same batches when the shape was static.

    Args:
        model: the ``.xml`` path or an ``openvino.Model``.
        threads: inference threads (default: ``torch.get_num_threads()``, so ``--threads`` applies).
        precision: ``"fp32"``, ``"bf16"`` or ``"int8"``: sets the compute precision (see the module notes).
        float_part: for int8, the precision of what int8 leaves in float, one of
            :data:`~cgavit.deploy.int8.FLOAT_PARTS` (default ``"fp32"``).

    Attributes:
        metadata: cgavit's keys of the model's ``rt_info`` (:mod:`cgavit.deploy.metadata`).
        input_shape, output_shape: the shapes of its first input and output (None for a dynamic dimension, or
            for a shape whose rank is dynamic).
        inputs, input_float32: how many inputs the model has; whether its first takes float32.

    Raises:
        ValueError: an unknown precision or float part, or a file :func:`read_openvino` refuses.
    """

    copyable = False

    def __init__(self, model, threads: int | None = None, precision: str = "fp32", float_part: str = "fp32") -> None:
        super().__init__(precision)
        if precision not in PRECISION_HINT:
            raise ValueError(f"OpenVINO precision must be one of {', '.join(PRECISION_HINT)}, got {precision!r}")
        if float_part not in FLOAT_PARTS:
            raise ValueError(f"an int8 float part is one of {', '.join(FLOAT_PARTS)}, got {float_part!r}")
        self.model = read_openvino(model) if isinstance(model, (str, os.PathLike)) else model
        self.input_shape, self.output_shape = (_declared_shape(port)
                                               for port in (self.model.input(0), self.model.output(0)))
        self.inputs = len(self.model.inputs)
        self.input_float32 = self.model.input(0).get_element_type().get_type_name() == "f32"
        self.runtime_errors = (RuntimeError,)
        self.metadata = openvino_metadata(self.model, str(model) if isinstance(model, (str, os.PathLike)) else
                                          "the OpenVINO model")
        self.float_part = float_part if precision == "int8" else precision
        hint = PRECISION_HINT[compile_precision(float_part) if precision == "int8" else precision]
        if hint == PRECISION_HINT["bf16"] and (error := capped_bf16_error(cpu_features())):
            raise ValueError(error)
        self.config = {"INFERENCE_NUM_THREADS": threads or torch.get_num_threads(), "NUM_STREAMS": 1,
                       "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": hint}
        self.compiled: dict[int, object] = {}  # batch size -> compiled model
        self._lock = threading.Lock()

    def compiled_for(self, batch: int):
        """The model compiled for inputs of ``batch`` images (compiled on first use)."""
        if batch not in self.compiled:
            shape = [dim.get_length() for dim in self.model.input(0).get_partial_shape()[1:]]  # (C, H, W)
            static = self.model.clone()
            static.reshape([batch, *shape])
            self.compiled[batch] = compile_cpu(static, self.config)
        return self.compiled[batch]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one call at a time: a compiled model's own call uses one infer request, and threads sharing it got
        # "Infer Request is busy" or, silently, another call's logits
        with self._lock:
            out = self.compiled_for(len(x))(x.detach().float().contiguous().numpy())[0]
            return torch.from_numpy(out.copy())


def read_openvino(path: str | os.PathLike):
    """The ``openvino.Model`` of an ``.xml`` file and the ``.bin`` beside it, the one it was written with where the
    ``.xml`` records it (:func:`check_weights`).

    Raises:
        ValueError: a file OpenVINO cannot read (truncated or corrupt XML, weights cut short), a model
            without an input or an output, or a ``.bin`` other than the one the ``.xml`` records.
        UnreadableFileError: the ``.bin`` beside it missing, a folder, empty or not a regular file (OpenVINO opened a
            pipe named ``m.bin`` and waited on it for ever).
    """
    if Path(path).suffix.lower() == ".xml":  # IR; OpenVINO reads other formats (ONNX) without a .bin
        _refuse_misplaced_weights(Path(path))
        check_readable_file(Path(path).with_suffix(".bin"), "OpenVINO weights (.bin beside the .xml)")
    core = _core()
    try:
        model = core.read_model(str(path))
    except RuntimeError as err:
        recorded = _text_weights_record(Path(path))
        if recorded is not None and Path(path).with_suffix(".bin").is_file():  # another export's .bin: said as such
            _match_weights(recorded, Path(path))
        raise unreadable_file(path, "OpenVINO IR with the .bin beside it", err) from None
    if not model.inputs or not model.outputs:
        raise ValueError(f"{path}: it has no input or no output, so it is not a network of images; export it again")
    check_weights(model, Path(path))
    return model


def _refuse_misplaced_weights(xml: Path) -> None:
    """Where the ``.bin`` OpenVINO reads beside ``xml`` (its name, suffix ``.bin``) is missing but the user's one is
    elsewhere, say where and what to do: one of that name in other letter case (``M.XML`` with ``M.BIN``, as a zip
    from a case-blind disk leaves them), to be renamed; or, for an ``xml`` that is a symbolic link, the ``.bin`` beside
    the file it links to, which OpenVINO (here and in any program the file is shipped to) does not look for. The
    error said only that ``M.bin`` does not exist."""
    weights = xml.with_suffix(".bin")
    if os.path.lexists(weights) or not xml.parent.is_dir():
        return
    found = sorted(p.name for p in xml.parent.iterdir() if p.name.lower() == weights.name.lower())
    if found:
        raise ValueError(f"OpenVINO reads the weights of {xml.name} from {weights.name} beside it, and the folder holds "
                         f"{' and '.join(found)}; rename {found[0]} to {weights.name}")
    target = xml.resolve()
    if xml.is_symlink() and target.with_suffix(".bin").is_file():
        raise ValueError(f"{xml} is a link to {target}, and OpenVINO reads the weights from beside the link, {weights}, "
                         f"not from beside the file it links to: link {target.with_suffix('.bin')} as {weights} too, or "
                         f"give {target}")


def _declared_shape(port) -> tuple[int | None, ...] | None:
    """A model input's or output's shape (None for a dynamic dimension), or None when its rank is dynamic."""
    shape = port.get_partial_shape()
    return None if shape.rank.is_dynamic else tuple(d.get_length() if d.is_static else None for d in shape)


def openvino_path(
    fused: nn.Module, example_input: torch.Tensor, precision: str, calibration: list[torch.Tensor] | None,
    float_part: str = "fp32",
) -> OpenVinoModule:
    """``fused`` converted for the example's image size (int8: quantised on ``calibration``, else on the
    example, its float part compiled in ``float_part``) and compiled by OpenVINO for the CPU, all in memory."""
    size = tuple(example_input.shape[2:])
    batches = (calibration or [example_input]) if precision == "int8" else None
    return OpenVinoModule(openvino_model(fused, size, precision, batches), precision=precision, float_part=float_part)
