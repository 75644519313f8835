"""What the CPU offers for reduced precision: the feature probe behind ``optimize(precision="auto")``.

The probe reads the kernel's flag list (``/proc/cpuinfo``: ``flags`` on x86, ``Features`` on Arm)
and torch's own dispatch level (``torch.backends.cpu.get_cpu_capability()``). Only the features the
inference paths care about are interpreted:

* ``amx_bf16`` + ``amx_tile``: Intel AMX (Sapphire Rapids and later), bf16 and int8 matrix tiles;
* ``avx512_bf16``: native bf16 dot products (Cooper Lake, Zen 4 and later);
* ``avx512_vnni`` / ``avx_vnni`` / ``amx_int8``: int8 dot products;
* ``avx512f``, ``avx2``: the float vector width.

Without a native bf16 instruction every bf16 operation converts to and from fp32; on an AVX2-only
AMD EPYC that made the bf16 path 12x slower than fp32 (BENCHMARKS.md).

**oneDNN's ISA cap.** ``ONEDNN_MAX_CPU_ISA`` (or its older name ``DNNL_MAX_CPU_ISA``), set before the
process starts, limits the instructions oneDNN's kernels use, and OpenVINO's and torch's oneDNN read
it. With ``AVX2`` on a VNNI CPU, OpenVINO's int8 convolutions run the AVX2 kernels, which saturate on
8-bit weights as on an AVX2-only CPU (on a Zen 4 EPYC 15 of the demo's 360 digits and 329 and 349 of
2,000 CIFAR-10 images changed decision; with 7-bit weights not one decision moved from that of the CPU's
own kernels; BENCHMARKS.md), and OpenVINO fails to compile bf16 because its kernels are gone. So the
probe counts a feature only where the cap lets oneDNN use it (:attr:`CpuFeatures.usable`), and every
choice made from it follows the cap. ONNX Runtime's kernels (MLAS) do not read it: its int8 gets 7-bit
weights under such a cap, which cannot saturate anywhere and cost it a few decisions where 8-bit ones
would not have. An unknown value is ignored, as oneDNN ignores it.

**The CPU this process runs on.** The kernel's list describes the machine. Under an emulator that
presents another CPU to the process (``qemu-x86_64 -cpu EPYC-Milan``, a Zen 3 EPYC, on an AMX Xeon) the kernels' own
dispatch follows the CPU's ``CPUID`` instead, so the probe counts a flag only where ``CPUID`` confirms
it too, as torch reads it (``torch.cpu._is_avx2_supported()`` and its siblings). On a real machine the
two agree. Where ``CPUID`` denies a flag the kernel lists, the list is another CPU's, and the flags
``CPUID`` cannot be asked about through torch (``avx_vnni``) count as absent. Under that emulator an
AMX Xeon so probes as class ``avx2``, and ONNX Runtime's int8 kernels there are the AVX2 ones that
saturate on 8-bit weights: the suite checks that class's ONNX Runtime int8 on any x86 machine with
``qemu-user`` that way, as it checks OpenVINO's under oneDNN's ISA cap.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

#: The CPU classes :attr:`CpuFeatures.cpu_class` returns, most capable first.
CPU_CLASSES = ("amx", "avx512_bf16", "avx512", "avx2", "other")

#: The environment variables oneDNN reads its ISA cap from, the first one set winning.
ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")

#: oneDNN's x86 ISA levels as the bit masks of its ``dnnl_cpu_isa_t`` (a level may use the ISAs whose
#: bits it contains). A value not here (``ALL``, a newer level, a typo) sets no cap that matters here.
ONEDNN_ISA_BITS = {
    "sse41": 0x1, "avx": 0x3, "avx2": 0x7, "avx2_vnni": 0xF, "avx2_vnni_2": 0x1F,
    "avx512_core": 0x27, "avx512_core_vnni": 0x67, "avx512_core_bf16": 0xE7,
    "avx10_1_512": 0x1EF, "avx512_core_fp16": 0x1EF,
    "avx10_1_512_amx": 0xFEF, "avx512_core_amx": 0xFEF,
    "avx10_1_512_amx_fp16": 0x1FEF, "avx512_core_amx_fp16": 0x1FEF,
}

#: The x86 flags whose presence torch reads from this process's ``CPUID``, and the function of
#: ``torch.cpu`` that reads each (see the module notes).
CPUID_PROBES = {
    "avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported", "avx512_vnni": "_is_vnni_supported",
    "avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported",
    "amx_bf16": "_is_amx_tile_supported", "amx_int8": "_is_amx_tile_supported",
}

#: The x86 flags the probe interprets, and the oneDNN level each needs.
_FLAG_LEVEL = {
    "avx2": "avx2", "avx_vnni": "avx2_vnni", "avx512f": "avx512_core", "avx512_vnni": "avx512_core_vnni",
    "avx512_bf16": "avx512_core_bf16", "amx_tile": "avx512_core_amx", "amx_int8": "avx512_core_amx",
    "amx_bf16": "avx512_core_amx",
}


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's instruction-set flags, as the kernel reports them.

    Args:
        flags: lower-case flag names (``/proc/cpuinfo``'s ``flags`` or ``Features`` line).
        capability: torch's CPU dispatch level (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...).
        model_name: the CPU's model name, for messages ("" when unknown).
        isa_cap: oneDNN's ISA cap, a key of :data:`ONEDNN_ISA_BITS` ("" for none; see the module notes).
        unconfirmed: the flags the kernel lists and this process's ``CPUID`` does not confirm, left out of
            ``flags`` (empty on a real machine; see the module notes).
    """

    flags: frozenset[str]
    capability: str = ""
    model_name: str = ""
    isa_cap: str = ""
    unconfirmed: frozenset[str] = frozenset()

    @property
    def usable(self) -> frozenset[str]:
        """The flags less those oneDNN's ISA cap keeps its kernels from using: what the properties read."""
        cap = ONEDNN_ISA_BITS.get(self.isa_cap)
        if cap is None:
            return self.flags
        return frozenset(f for f in self.flags if f not in _FLAG_LEVEL or (ONEDNN_ISA_BITS[_FLAG_LEVEL[f]] & ~cap) == 0)

    @property
    def hidden(self) -> frozenset[str]:
        """The flags the CPU has and oneDNN's ISA cap hides (empty without a cap)."""
        return self.flags - self.usable

    @property
    def amx(self) -> bool:
        """Intel AMX tiles with bf16 (``amx_bf16`` and ``amx_tile``)."""
        return {"amx_bf16", "amx_tile"} <= self.usable

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware: AMX, ``avx512_bf16``, or Arm's ``bf16``."""
        return self.amx or bool({"avx512_bf16", "bf16"} & self.usable)

    @property
    def vnni(self) -> bool:
        """int8 dot-product instructions: ``avx512_vnni``, ``avx_vnni``, ``amx_int8``, or Arm's ``asimddp``."""
        return bool({"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"} & self.usable)

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.usable

    @property
    def avx2(self) -> bool:
        return "avx2" in self.usable

    @property
    def cpu_class(self) -> str:
        """One of :data:`CPU_CLASSES`: the row of the ``auto`` rule table this CPU uses."""
        if self.amx:
            return "amx"
        if "avx512_bf16" in self.usable:
            return "avx512_bf16"
        if self.avx512:
            return "avx512"
        if self.avx2:
            return "avx2"
        return "other"

    def describe(self) -> str:
        """One line: model, class and the flags that matter here, e.g. ``"... (amx: amx_bf16, avx512_bf16, ...)"``."""
        shown = [f for f in ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_vnni", "avx_vnni",
                             "avx512f", "avx2", "bf16", "asimddp") if f in self.usable]
        name = f"{self.model_name} " if self.model_name else ""
        capped = f"; {', '.join(sorted(self.hidden))} hidden by oneDNN's ISA cap " \
                 f"{self.isa_cap.upper()} ({' or '.join(ISA_CAP_VARIABLES)})" if self.hidden else ""
        denied = f"; {', '.join(sorted(self.unconfirmed))} listed by the kernel but not this process's CPUID " \
                 "(an emulator?)" if self.unconfirmed else ""
        return f"{name}(class {self.cpu_class}: {', '.join(shown) or 'none of amx/avx512/avx2'}{capped}{denied})"


#: Names the same instruction set goes by (``platform.machine()`` differs between systems).
_ARCHITECTURE_NAMES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def architecture() -> str:
    """This process's instruction set, e.g. ``"x86_64"`` or ``"aarch64"`` (``platform.machine()``, one name each)."""
    name = platform.machine().lower()
    return _ARCHITECTURE_NAMES.get(name, name)


def parse_cpuinfo(text: str) -> tuple[frozenset[str], str]:
    """The flag set and model name of the first processor in a ``/proc/cpuinfo`` text."""
    flags: frozenset[str] = frozenset()
    model = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and not flags:
            flags = frozenset(value.lower().split())
        elif key == "model name" and not model:
            model = value.strip()
    return flags, model


def onednn_isa_cap(environ: Mapping[str, str] | None = None) -> str:
    """oneDNN's ISA cap in ``environ`` (default: this process's environment), lower case; "" for none or
    a value oneDNN does not know."""
    environ = os.environ if environ is None else environ
    value = next((environ[name] for name in ISA_CAP_VARIABLES if environ.get(name)), "").strip().lower()
    return value if value in ONEDNN_ISA_BITS else ""


def uncapped_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's environment) without oneDNN's ISA cap: a child process started with it
    sees the CPU's own instruction sets (or, under an emulator, the emulated CPU's)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k not in ISA_CAP_VARIABLES}


def cpuid_flags() -> dict[str, bool]:
    """What this process's ``CPUID`` says of each flag of :data:`CPUID_PROBES`, as torch reads it; empty
    off x86 or where this torch lacks the probes."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return {}
    try:
        return {flag: bool(getattr(torch.cpu, probe)()) for flag, probe in CPUID_PROBES.items()}
    except (AttributeError, RuntimeError):
        return {}


def confirmed_flags(flags: frozenset[str], cpuid: Mapping[str, bool]) -> frozenset[str]:
    """``flags`` (the kernel's list) less what ``cpuid`` (:func:`cpuid_flags`) denies; where it denies any of
    them, the list is another CPU's and ``avx_vnni``, which ``cpuid`` cannot confirm, goes too."""
    denied = {flag for flag, present in cpuid.items() if not present and flag in flags}
    if denied:
        denied |= {"avx_vnni"} & flags
    return flags - denied


def cpu_features(
    cpuinfo: str | Path = "/proc/cpuinfo", environ: Mapping[str, str] | None = None,
    cpuid: Mapping[str, bool] | None = None,
) -> CpuFeatures:
    """Probe this machine's CPU (or read another machine's ``cpuinfo`` file, e.g. in tests), with oneDNN's
    ISA cap from ``environ`` (default: this process's environment) and the flags ``cpuid`` denies left out
    (default: this process's ``CPUID`` when reading ``/proc/cpuinfo``, nothing for another file; see the
    module notes).

    When the file cannot be read (not Linux), the flags are inferred from torch's dispatch level
    alone: ``AVX512`` -> ``avx512f``, ``AVX2`` -> ``avx2``; native bf16 and VNNI then count as absent.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if cpuid is None:
        cpuid = cpuid_flags() if str(cpuinfo) == "/proc/cpuinfo" else {}
    try:
        flags, model = parse_cpuinfo(Path(cpuinfo).read_text())
    except OSError:
        flags, model = frozenset(), platform.processor()
    if not flags:
        implied = {"AVX512": {"avx512f", "avx2"}, "AVX2": {"avx2"}}.get(capability, set())
        flags = frozenset(implied)
    kept = confirmed_flags(flags, cpuid)
    return CpuFeatures(flags=kept, capability=capability, model_name=model, isa_cap=onednn_isa_cap(environ),
                       unconfirmed=flags - kept)
