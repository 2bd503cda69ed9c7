"""Machine facts for the report header, and the slug that names the report folder (``linux-x86_64-2c``)."""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata

import torch


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else whatever ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_facts() -> dict:
    """What a reader needs to compare this report's figures with another machine's."""
    facts = {
        "platform": platform.platform(),
        "system": platform.system().lower(),
        "arch": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "ray": _version("ray"),
        "numpy": _version("numpy"),
        "cuda": torch.cuda.is_available(),
    }
    if facts["cuda"]:
        facts["gpu"] = torch.cuda.get_device_name(0)
    try:
        facts["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return facts


def machine_slug(facts: dict) -> str:
    """Platform + architecture + cores (+ the GPU's short name when there is one): ``linux-x86_64-2c``."""
    parts = [facts.get("system") or "unknown", facts.get("arch") or "unknown", f"{facts.get('cpu_count') or 0}c"]
    if facts.get("gpu"):
        parts.append(re.sub(r"[^a-z0-9]+", "-", facts["gpu"].lower()).strip("-")[:24])
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "-", p) for p in parts)
