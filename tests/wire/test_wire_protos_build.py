"""protos/build.py and specula.protos.load: generated on demand, hash-based staleness, safe under concurrency."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specula.protos import build, load
from specula.runtime.bench.report.reliability import record_figure

PROTO = build.PROTO_DIR / "specula_dataplane.proto"


def test_load_imports_messages_and_service():
    dp = load("specula_dataplane")
    assert dp.pb2.DataplaneFrame.DESCRIPTOR.full_name == "specula.dataplane.v1.DataplaneFrame"
    assert hasattr(dp.pb2_grpc, "DrafterServiceStub") and hasattr(dp.pb2_grpc, "add_DrafterServiceServicer_to_server")
    assert build.is_current()
    with pytest.raises(ValueError, match="no protos/nope.proto"):
        load("nope")


def test_generated_code_is_ignored_by_git():
    root = build.PROTO_DIR.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", "protos/_generated/specula_dataplane_pb2.py"], cwd=root)
    assert done.returncode == 0


def make_package(tmp_path: Path) -> tuple[Path, Path]:
    """A fresh 'clone': package tmpkg with a copy of the .proto and no generated code."""
    pkg = tmp_path / "tmpkg"
    (pkg / "protos").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "protos" / "__init__.py").write_text("")
    shutil.copy(PROTO, pkg / "protos" / PROTO.name)
    return pkg / "protos", pkg / "protos" / "_gen"


def run_py(code: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_concurrent_generation_in_a_fresh_checkout(tmp_path):
    proto_dir, gen_dir = make_package(tmp_path)
    code = f"""
        from specula.protos import build
        build.ensure_generated({str(proto_dir)!r}, {str(gen_dir)!r}, "tmpkg.protos._gen")
        import tmpkg.protos._gen.specula_dataplane_pb2 as pb2
        import tmpkg.protos._gen.specula_dataplane_pb2_grpc as pb2_grpc
        f = pb2.DataplaneFrame(request_id="x", verdict=pb2.Verdict(next_token=3))
        assert pb2.DataplaneFrame.FromString(f.SerializeToString()) == f and pb2_grpc.DrafterServiceStub
        print("ok")
    """
    procs = [run_py(code, tmp_path) for _ in range(4)]  # all racing to generate the same files
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err
    assert build.is_current(proto_dir, gen_dir)
    assert not [p for p in gen_dir.iterdir() if p.name.startswith(".tmp-")]  # temp folders cleaned up


def test_an_edited_proto_regenerates(tmp_path):
    proto_dir, gen_dir = make_package(tmp_path)
    build.ensure_generated(proto_dir, gen_dir, "tmpkg.protos._gen")
    stamp = (gen_dir / build.STAMP).read_text()
    before = (gen_dir / "specula_dataplane_pb2.py").stat().st_mtime_ns
    build.ensure_generated(proto_dir, gen_dir, "tmpkg.protos._gen")  # current: nothing rewritten
    assert (gen_dir / "specula_dataplane_pb2.py").stat().st_mtime_ns == before
    proto = proto_dir / PROTO.name
    proto.write_text(proto.read_text().replace("string reason = 1;", "string reason = 1;\n  uint32 code = 2;"))
    assert not build.is_current(proto_dir, gen_dir)
    build.ensure_generated(proto_dir, gen_dir, "tmpkg.protos._gen")
    assert (gen_dir / build.STAMP).read_text() != stamp
    out = run_py("""
        import tmpkg.protos._gen.specula_dataplane_pb2 as pb2
        print(pb2.Release(code=5).code)
    """, tmp_path).communicate(timeout=60)[0]
    assert out.strip() == "5"


def test_a_deleted_module_regenerates(tmp_path):
    proto_dir, gen_dir = make_package(tmp_path)
    build.ensure_generated(proto_dir, gen_dir, "tmpkg.protos._gen")
    (gen_dir / "specula_dataplane_pb2_grpc.py").unlink()
    assert not build.is_current(proto_dir, gen_dir)
    build.ensure_generated(proto_dir, gen_dir, "tmpkg.protos._gen")
    assert (gen_dir / "specula_dataplane_pb2_grpc.py").is_file()


def test_a_broken_proto_fails_with_protocs_message(tmp_path):
    proto_dir, gen_dir = make_package(tmp_path)
    (proto_dir / PROTO.name).write_text('syntax = "proto3";\nmessage X { strin y = 1; }\n')
    with pytest.raises(RuntimeError, match="protoc failed"):
        build.generate(proto_dir, gen_dir, "tmpkg.protos._gen")
    assert not (gen_dir / build.STAMP).exists()


def test_build_script_runs_standalone():
    done = subprocess.run([sys.executable, str(build.PROTO_DIR / "build.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "_generated" in done.stdout, done.stderr


def test_no_pickle_on_the_wire():
    wire = Path(build.PROTO_DIR.parent / "runtime" / "wire")
    unsafe = re.compile(r"import pickle|from pickle|pickle\.loads?\(|torch\.load\(|np\.load\(|allow_pickle=True")
    scanned = [*wire.glob("*.py"), *build.PROTO_DIR.glob("*.py")]
    for path in scanned:
        assert not unsafe.search(path.read_text()), path
    record_figure("test_no_pickle_on_the_wire", f"{len(scanned)} wire-path files scanned: 0 pickle / torch.load / "
                  "np.load / allow_pickle uses", files=len(scanned), pickle_uses=0)
