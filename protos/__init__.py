"""specula.protos: the .proto files and a loader for their generated code (a build output, see build.py).

    >>> from specula.protos import load
    >>> dp = load("specula_dataplane")
    >>> frame = dp.pb2.DataplaneFrame(request_id="r1")
    >>> stub = dp.pb2_grpc.DrafterServiceStub(channel)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import NamedTuple

from .build import GEN_PACKAGE, PROTO_DIR, ensure_generated


class Generated(NamedTuple):
    pb2: ModuleType  # messages and enums
    pb2_grpc: ModuleType  # service stubs, servicers, add_*_to_server


@functools.cache
def load(name: str) -> Generated:
    """Import the generated modules of ``protos/<name>.proto``, (re)generating them first if they are stale.

    Cached per process: once imported, a module stays (protobuf's descriptor pool cannot take a second version of
    the same messages), so an edit to a .proto takes effect in the next process.
    """
    if not (PROTO_DIR / f"{name}.proto").is_file():
        known = sorted(p.stem for p in PROTO_DIR.glob("*.proto"))
        raise ValueError(f"no protos/{name}.proto; known: {known}")
    ensure_generated()
    importlib.invalidate_caches()  # the files may be newer than this process's import-path caches
    pb2 = importlib.import_module(f"{GEN_PACKAGE}.{name}_pb2")
    pb2_grpc = importlib.import_module(f"{GEN_PACKAGE}.{name}_pb2_grpc")
    return Generated(pb2, pb2_grpc)


__all__ = ["Generated", "load"]
