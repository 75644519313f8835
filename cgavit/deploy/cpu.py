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
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

#: The CPU classes :attr:`CpuFeatures.cpu_class` returns, most capable first.
CPU_CLASSES = ("amx", "avx512_bf16", "avx512", "avx2", "other")


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's instruction-set flags, as the kernel reports them.

    Args:
        flags: lower-case flag names (``/proc/cpuinfo``'s ``flags`` or ``Features`` line).
        capability: torch's CPU dispatch level (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...).
        model_name: the CPU's model name, for messages ("" when unknown).
    """

    flags: frozenset[str]
    capability: str = ""
    model_name: str = ""

    @property
    def amx(self) -> bool:
        """Intel AMX tiles with bf16 (``amx_bf16`` and ``amx_tile``)."""
        return {"amx_bf16", "amx_tile"} <= self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware: AMX, ``avx512_bf16``, or Arm's ``bf16``."""
        return self.amx or "avx512_bf16" in self.flags or "bf16" in self.flags

    @property
    def vnni(self) -> bool:
        """int8 dot-product instructions: ``avx512_vnni``, ``avx_vnni``, ``amx_int8``, or Arm's ``asimddp``."""
        return bool({"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"} & self.flags)

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def cpu_class(self) -> str:
        """One of :data:`CPU_CLASSES`: the row of the ``auto`` rule table this CPU uses."""
        if self.amx:
            return "amx"
        if "avx512_bf16" in self.flags:
            return "avx512_bf16"
        if self.avx512:
            return "avx512"
        if self.avx2:
            return "avx2"
        return "other"

    def describe(self) -> str:
        """One line: model, class and the flags that matter here, e.g. ``"... (amx: amx_bf16, avx512_bf16, ...)"``."""
        shown = [f for f in ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_vnni", "avx_vnni",
                             "avx512f", "avx2", "bf16", "asimddp") if f in self.flags]
        name = f"{self.model_name} " if self.model_name else ""
        return f"{name}(class {self.cpu_class}: {', '.join(shown) or 'none of amx/avx512/avx2'})"


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


def cpu_features(cpuinfo: str | Path = "/proc/cpuinfo") -> CpuFeatures:
    """Probe this machine's CPU (or read another machine's ``cpuinfo`` file, e.g. in tests).

    When the file cannot be read (not Linux), the flags are inferred from torch's dispatch level
    alone: ``AVX512`` -> ``avx512f``, ``AVX2`` -> ``avx2``; native bf16 and VNNI then count as absent.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        flags, model = parse_cpuinfo(Path(cpuinfo).read_text())
    except OSError:
        flags, model = frozenset(), platform.processor()
    if not flags:
        implied = {"AVX512": {"avx512f", "avx2"}, "AVX2": {"avx2"}}.get(capability, set())
        flags = frozenset(implied)
    return CpuFeatures(flags=flags, capability=capability, model_name=model)
