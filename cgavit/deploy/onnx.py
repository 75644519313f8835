"""ONNX: export (batch dynamic, image size fixed), ONNX Runtime as a module, int8 static quantisation.

ONNX Runtime (the ``cgavit[deploy]`` extra) is imported in one place, :func:`_onnxruntime`, on first
use: it is optional and slow to import, and ``import cgavit`` must not need it.
"""

from __future__ import annotations

import errno
import io
import json
import os
import statistics
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from ..io import WriteError, atomic_write, write_error, write_reason
from .cpu import CpuFeatures, cpu_features
from .fusion import example_batch, export_form, output_path
from .int8 import Int8Options, layer_of_onnx_node
from .metadata import PREFIX, ExportInfo, export_info, int8_info, unreadable_file
from .runtime import RuntimeModule, import_problem, quiet_quantiser, runtime_reason


def _onnx() -> ModuleType:
    """The one place the ``onnx`` package is imported (graph names, metadata; part of ``cgavit[deploy]``)."""
    import onnx

    return onnx


def _onnxruntime(quantization: bool = False) -> ModuleType:
    """The one place ONNX Runtime is imported (lazily: an optional extra, about a second to import).

    With ``quantization`` its ``quantization`` and ``quantization.shape_inference`` submodules are
    loaded too (they pull in ``onnx``).
    """
    import onnxruntime

    if quantization:
        import onnxruntime.quantization.shape_inference  # noqa: F401  (sets the submodule attributes)
    return onnxruntime


def onnxruntime_available() -> bool:
    """Whether ONNX Runtime and ``onnx`` (every path through it exports an ONNX graph first) are installed and
    import (:func:`~cgavit.deploy.runtime.import_problem`)."""
    return onnxruntime_problem() is None


def onnxruntime_problem() -> str | None:
    """Why the ONNX Runtime paths cannot be used here, or None."""
    return import_problem("onnxruntime") or import_problem("onnx")


def opset_range() -> tuple[int, int]:
    """The ONNX opsets this torch's TorchScript-based exporter writes (its own table: 7..23 in torch 2.14; 7..20, what
    every torch cgavit supports writes, where a torch keeps the table elsewhere)."""
    try:
        from torch.onnx import _constants
    except ImportError:
        return 7, 20
    return getattr(_constants, "ONNX_MIN_OPSET", 7), getattr(_constants, "ONNX_MAX_OPSET", 20)


def check_opset(opset: object) -> None:
    """Raise ValueError unless ``opset`` is a whole number within :func:`opset_range`: torch wrote an opset-1 file that
    ONNX Runtime could not load for ``True``, and for an opset it lacks printed its whole traced graph first."""
    lo, hi = opset_range()
    if isinstance(opset, bool) or not isinstance(opset, int) or not lo <= opset <= hi:
        raise ValueError(f"opset must be a whole number within {lo}..{hi} (the ONNX opsets this torch exports), "
                         f"got {opset!r}")


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    img_size: tuple[int, int] = (224, 224),
    opset: int = 17,
    fold_residuals: bool = True,
    info: ExportInfo | None = None,
) -> Path:
    """Export ``model``'s inference form (:func:`~cgavit.deploy.fusion.export_form`) to an ONNX file
    with a dynamic batch dimension, written atomically.

    The image size is fixed at ``img_size``: the local window attention pads and partitions
    differently depending on each stage's map size, so one graph cannot serve every size (export
    once per size you deploy). The TorchScript-based exporter is used: for this model it gives the
    same graph as the dynamo exporter in seconds instead of minutes.

    Args:
        model: the model (fused here; a fused model is fine too).
        path: output ``.onnx`` file.
        img_size: ``(H, W)`` the file will accept.
        opset: ONNX opset. Default 17.
        fold_residuals: fold depthwise residuals into their convs (default; int8 sources keep them).
        info: metadata to write into the file's ``metadata_props`` (:class:`~cgavit.deploy.metadata.ExportInfo`;
            default: the image size alone, ImageNet's preprocessing).

    Returns:
        The path written.

    Raises:
        ValueError: the parent folder does not exist, an opset outside :func:`opset_range`, or the exporter cannot
            hold the model (an operator ONNX has not, ``onnx`` missing).
        WriteError: the file cannot be written.
    """
    check_opset(opset)
    path = output_path(path)
    fused = export_form(model, img_size, fold_residuals)
    x = example_batch(fused, img_size)
    graph = io.BytesIO()  # exported in memory: a failure is the exporter's, not the disk's
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer and deprecation notices, nothing actionable
            torch.onnx.export(
                fused, (x,), graph, dynamo=False, input_names=["images"], output_names=["logits"],
                dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}}, opset_version=opset,
            )
    except (RuntimeError, ImportError) as err:  # torch.onnx's own errors are RuntimeErrors
        raise ValueError(f"cannot export the model to ONNX: {runtime_reason(err)}; optimize(..., backend='torch') "
                         "runs it without an export") from None
    data = with_onnx_metadata(graph.getvalue(), export_info(info, img_size, getattr(model, "in_chans", 3)))
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def onnx_file_bytes(path: Path) -> bytes:
    """The ONNX file at ``path`` as one block of bytes for ONNX Runtime, with the weights it keeps in external data
    files (``onnx.save(..., save_as_external_data=True)``, as a model edited with the ``onnx`` package may be saved)
    read in from beside it. Given the file's own bytes, ONNX Runtime looked for those files in the current folder: from
    another folder it refused the file as 'truncated or corrupt?', and from a folder holding another export's data file
    of that name it ran that export's weights without a word.

    Raises:
        ValueError: an external data file that is missing, cut short or outside the file's folder, named.
    """
    data = path.read_bytes()
    onnx = _onnx()
    try:
        proto = onnx.load_from_string(data)
    except Exception:  # not a protobuf (a DecodeError, or others): ONNX Runtime's own load says what is wrong
        return data
    try:
        onnx.external_data_helper.load_external_data_for_model(proto, str(path.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as err:
        raise ValueError(f"cannot read {path}: its weights are kept in external data files beside it, and "
                         f"{runtime_reason(err)}; keep the .onnx with the data files it was saved with") from None
    return data if proto.ByteSize() == len(data) else proto.SerializeToString()  # same size: nothing was read in


class OnnxModule(RuntimeModule):
    """An ONNX file run by ONNX Runtime on the CPU, called like a module on torch tensors.

    Args:
        path: the ``.onnx`` file or its bytes (read into memory with any external data files beside it
            (:func:`onnx_file_bytes`), so the files may be deleted afterwards).
        threads: intra-op threads (default: ``torch.get_num_threads()``, so ``--threads`` applies).
        precision: what the file computes in, for display (``"fp32"`` or ``"int8"``).

    Attributes:
        metadata: the file's ``metadata_props`` (``{key: value}``; cgavit's keys: :mod:`cgavit.deploy.metadata`).
        input_shape, output_shape: the shapes of its first input and output as the file declares them (None for
            a dynamic dimension).
        inputs, input_float32: how many inputs the graph has; whether its first takes float32.

    Raises:
        ValueError: a file ONNX Runtime cannot load (truncated, corrupt, not ONNX, its external data files missing),
            or a graph without an input or an output.
    """

    copyable = False

    def __init__(self, path: str | os.PathLike | bytes, threads: int | None = None, precision: str = "fp32") -> None:
        super().__init__(precision)
        ort = _onnxruntime()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        data = path if isinstance(path, bytes) else onnx_file_bytes(Path(path))
        errors = ort.capi.onnxruntime_pybind11_state
        try:
            self.session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        except (errors.Fail, errors.InvalidArgument, errors.InvalidGraph, errors.InvalidProtobuf, errors.NoModel,
                errors.NotImplemented, errors.RuntimeException) as err:
            if isinstance(path, bytes):  # built here, not read from a file: a defect of ours
                raise
            raise unreadable_file(path, "an ONNX model", err) from None
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if not inputs or not outputs:
            raise ValueError(f"{'the ONNX model' if isinstance(path, bytes) else path}: its graph has no input or no "
                             "output, so it is not a network of images; export it again")
        self.input_name = inputs[0].name
        self.input_shape, self.output_shape = (tuple(d if isinstance(d, int) else None for d in arg.shape)
                                               for arg in (inputs[0], outputs[0]))
        self.inputs, self.input_float32 = len(inputs), inputs[0].type == "tensor(float)"
        self.runtime_errors = (errors.Fail, errors.InvalidArgument, errors.RuntimeException, errors.NotImplemented)
        self.metadata: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.session.run(None, {self.input_name: x.detach().float().contiguous().numpy()})[0]
        return torch.from_numpy(out)


#: Activations ONNX Runtime fuses into the convolution before them (the fused node is named after their output).
FUSED_ACTIVATIONS = ("Relu", "Sigmoid", "Clip", "HardSigmoid", "LeakyRelu", "Tanh")


def onnxruntime_conv_times(
    model: str | os.PathLike | bytes, example: torch.Tensor, layers: Iterable[str], threads: int = 1, runs: int = 5,
) -> dict[str, float]:
    """Milliseconds each convolution layer's kernel takes per call of ``example`` in ONNX Runtime, from its
    profiler (the median of ``runs`` calls after one untimed), for an fp32 or an int8 file.

    A profiled node is the layer its name says (``.../pw1/Conv...`` -> ``...pw1``), or, for an fp32
    convolution that graph optimisation fused with its activation and renamed after its output
    (``..._nchwc``), the layer whose convolution, or the activation after it, wrote that output.

    Args:
        model: the ONNX file or its bytes.
        example: an input batch.
        layers: the layer names to look for (e.g. :attr:`OnnxInt8Builder.layers`); others are ignored.
        threads, runs: intra-op threads, and timed calls.
    """
    ort, onnx = _onnxruntime(), _onnx()
    wanted = set(layers)
    data = model if isinstance(model, bytes) else Path(model).read_bytes()
    written: dict[str, str] = {}  # tensor -> the layer whose convolution (or the activation after it) wrote it
    for n in onnx.load_from_string(data).graph.node:
        if n.op_type == "Conv":
            written[n.output[0]] = layer_of_onnx_node(n.name)
        elif n.op_type in FUSED_ACTIVATIONS and n.input[0] in written:
            written[n.output[0]] = written[n.input[0]]
    with tempfile.TemporaryDirectory(prefix="cgavit-profile-") as tmp:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.enable_profiling, opts.profile_file_prefix = True, str(Path(tmp) / "profile")
        session = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        feed = {session.get_inputs()[0].name: example.detach().float().contiguous().numpy()}
        for _ in range(runs + 1):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    calls: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or \
                "Conv" not in e.get("args", {}).get("op_name", ""):
            continue
        node = e["name"].removesuffix("_kernel_time")
        named = (layer_of_onnx_node(node), written.get(node.removesuffix("_nchwc")))
        layer = next((name for name in named if name in wanted), None)
        if layer is not None:
            calls[layer].append(e["dur"] / 1000.0)
    return {layer: statistics.median(times[1:] or times) for layer, times in calls.items()}


@contextmanager
def full_disk_said(path: Path) -> Iterator[None]:
    """ONNX Runtime's quantiser writing ``path`` (and its other files beside it) on a disk that fills: it fails as
    an ``OSError``, a protobuf error on the file it wrote cut short, or an ONNX Runtime error, each raised here as the
    :class:`~cgavit.io.WriteError` of a full disk (one line, what to do); any other failure as it was."""
    try:
        yield
    except WriteError:
        raise
    except Exception as err:
        if write_reason(err, path.parent)[0] not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise write_error(path, err) from err


class _CalibrationReader:
    """Feeds image batches to ONNX Runtime's calibration (its ``CalibrationDataReader`` interface)."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.it = iter([{"images": b.float().numpy()} for b in batches])

    def get_next(self) -> dict | None:
        return next(self.it, None)


def even_batches(images: torch.Tensor, most: int = 32) -> list[torch.Tensor]:
    """``images`` ``(N, C, H, W)`` in batches of one size, the largest divisor of N up to ``most``
    (ONNX Runtime's histogram calibrators stack the batches: ragged ones fail, "inhomogeneous shape")."""
    size = next(b for b in range(min(most, len(images)), 0, -1) if len(images) % b == 0)
    return list(images.split(size))


#: The ONNX operators ONNX Runtime's int8 builds quantise (:class:`OnnxInt8Builder`).
QUANTIZED_OPS = ("Conv", "Relu")


class OnnxInt8Builder:
    """int8 versions of one exported fp32 ONNX file, with any of its layers kept in float, for ONNX Runtime.

    The ranges are calibrated once, on the first build, and reused (ONNX Runtime's calibration
    cache), so that the per-layer sensitivity costs one quantisation per layer, not one calibration.
    Weights per channel (symmetric int8, 7-bit with ``reduce_range``), activations per tensor
    (asymmetric uint8), QDQ format, convolutions and the ReLUs that follow them (quantised together,
    one range for the ReLU's output, so that ONNX Runtime fuses each pair into one int8 convolution
    instead of requantising between them: 1.28x -> 1.44x fp32 on M4 at AVX2, BENCHMARKS.md); the
    attention's matmuls and softmax and the residual adds stay float. Use it as a context manager (it
    holds a temporary folder).

    Args:
        src: the fp32 ONNX file (exported with ``fold_residuals=False``).
        calibration: image batches ``(B, C, H, W)`` preprocessed like the model's input (training images).
        options: the choices (``reduce_range`` must be decided: :meth:`Int8Options.for_cpu`).

    Raises:
        ValueError: no calibration image, or ``reduce_range`` left undecided.
    """

    def __init__(self, src: str | os.PathLike, calibration: Iterable[torch.Tensor], options: Int8Options) -> None:
        batches = [b.float() for b in calibration]
        if not batches or not sum(len(b) for b in batches):
            raise ValueError("int8 calibration needs at least one image batch")
        if options.reduce_range is None:
            raise ValueError("decide reduce_range first: options.for_cpu(cpu_features())")
        self.options = options
        self.batches = even_batches(torch.cat(batches))
        self.quant = _onnxruntime(quantization=True).quantization
        self._tmp = tempfile.TemporaryDirectory(prefix="cgavit-int8-")
        self.pre = Path(self._tmp.name) / "pre.onnx"
        self.cache = Path(self._tmp.name) / "ranges.json"
        try:
            with full_disk_said(self.pre):
                self.quant.shape_inference.quant_pre_process(str(src), str(self.pre), skip_symbolic_shape=True)
                nodes = _onnx().load(str(self.pre)).graph.node
        except BaseException:
            self.close()
            raise
        readers: dict[str, list] = {}
        for n in nodes:
            for tensor in n.input:
                readers.setdefault(tensor, []).append(n)
        # layer name -> its Conv node and the ReLU it alone feeds (a layer kept in float keeps that ReLU too)
        self._nodes: dict[str, list[str]] = {}
        for n in (n for n in nodes if n.op_type == "Conv"):
            after = readers.get(n.output[0], [])
            relu = [after[0].name] if len(after) == 1 and after[0].op_type == "Relu" else []
            self._nodes[layer_of_onnx_node(n.name)] = [n.name, *relu]
        #: layer name -> its Conv node's name, in graph order
        self.layers = {layer: names[0] for layer, names in self._nodes.items()}

    def __enter__(self) -> OnnxInt8Builder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the temporary files."""
        self._tmp.cleanup()

    def build(self, float_layers: Iterable[str] = ()) -> bytes:
        """The int8 ONNX file (bytes) with ``float_layers`` kept in float.

        Raises:
            ValueError: a layer name the graph does not have.
        """
        keep = list(float_layers)
        unknown = [name for name in keep if name not in self.layers]
        if unknown:
            raise ValueError(f"no such layer in the exported graph: {', '.join(unknown)} (its layers: "
                             f"{', '.join(list(self.layers)[:3])}, ...)")
        q, opts = self.quant, self.options
        method = {"minmax": q.CalibrationMethod.MinMax, "percentile": q.CalibrationMethod.Percentile,
                  "entropy": q.CalibrationMethod.Entropy}[opts.calibration]
        out = Path(self._tmp.name) / "int8.onnx"
        with full_disk_said(out), quiet_quantiser("ONNX Runtime's quantize_static"):
            q.quantize_static(
                str(self.pre), str(out), None if self.cache.exists() else _CalibrationReader(self.batches),
                quant_format=q.QuantFormat.QDQ, per_channel=True, reduce_range=opts.reduce_range and opts.weights == "int8",
                activation_type=q.QuantType.QUInt8, op_types_to_quantize=list(QUANTIZED_OPS),
                weight_type=q.QuantType.QUInt8 if opts.weights == "uint8" else q.QuantType.QInt8,
                nodes_to_exclude=[node for name in keep for node in self._nodes[name]], calibrate_method=method,
                calibration_cache_path=str(self.cache), extra_options={"CalibPercentile": 99.999},
            )
        return out.read_bytes()


def quantize_onnx(
    src: str | os.PathLike, dst: str | os.PathLike, calibration: Iterable[torch.Tensor],
    options: Int8Options | None = None, features: CpuFeatures | None = None, info: ExportInfo | None = None,
) -> Path:
    """int8 static quantisation of an exported ONNX file for ONNX Runtime (written atomically).

    Weights per channel, activations per tensor (QDQ format), ranges from ``calibration`` (image
    batches ``(B, C, H, W)`` preprocessed like the model's input; use real training images); the
    weight range is chosen for ``features`` (default: this CPU; see :mod:`cgavit.deploy.int8`).

    Args:
        src, dst: the fp32 file (exported with ``fold_residuals=False``) and the int8 file to write.
        calibration: image batches.
        options: how to quantise (default :class:`~cgavit.deploy.int8.Int8Options`).
        features: the CPU to quantise for (default: this machine's).
        info: metadata to write into the file (precision and weight range are filled in; default: what ``src``
            carries, which :func:`export_onnx` writes: at least its image size).

    Raises:
        ValueError: no calibration batch, or an unknown float layer.
    """
    opts = (options or Int8Options()).for_cpu(features or cpu_features())
    info = info or _source_info(src)
    with OnnxInt8Builder(src, calibration, opts) as builder:
        data = builder.build(opts.float_layers)
    data = with_onnx_metadata(data, int8_info(info, opts))
    return atomic_write(dst, lambda tmp: Path(tmp).write_bytes(data))


def _source_info(src: str | os.PathLike) -> ExportInfo:
    """The metadata an fp32 file carries (:func:`export_onnx` writes at least its image size), else its input's size."""
    proto = _onnx().load(str(src), load_external_data=False)
    props = {p.key: p.value for p in proto.metadata_props}
    if any(key.startswith(f"{PREFIX}.") for key in props):
        return ExportInfo.from_props(props, str(src))
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    return ExportInfo(img_size=(dims[2], dims[3])) if len(dims) == 4 and dims[2] > 0 and dims[3] > 0 else ExportInfo()


def with_onnx_metadata(data: bytes, info: ExportInfo) -> bytes:
    """The ONNX file ``data`` with ``info`` in its ``metadata_props`` (earlier cgavit keys replaced)."""
    onnx = _onnx()
    proto = onnx.load_from_string(data)
    props = info.to_props()
    kept = [(p.key, p.value) for p in proto.metadata_props if p.key not in props]
    del proto.metadata_props[:]
    for key, value in kept + list(props.items()):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    return proto.SerializeToString()


def onnxruntime_path(
    fused: nn.Module, example_input: torch.Tensor, precision: str, calibration: list[torch.Tensor] | None
) -> OnnxModule:
    """``fused`` exported for the example's image size (int8: quantised on ``calibration``, else on the
    example) and loaded into ONNX Runtime; the temporary files are gone when this returns."""
    with tempfile.TemporaryDirectory() as tmp:
        path = export_onnx(fused, Path(tmp) / "model.onnx", tuple(example_input.shape[2:]), fold_residuals=precision != "int8")
        if precision == "int8":
            path = quantize_onnx(path, Path(tmp) / "model.int8.onnx", calibration or [example_input])
        return OnnxModule(path, precision=precision)  # reads the file into memory: the folder may go
