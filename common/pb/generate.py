"""Regenerate the Python code in common/pb/ from protos/: `python -m common.pb.generate`.

Runs grpc_tools.protoc on every .proto under protos/ and writes `*_pb2.py`, `*_pb2.pyi` and
`*_pb2_grpc.py` under common/pb/, mirroring the proto paths, with an `__init__.py` in every
package directory. protoc emits imports relative to protos/ (`from disagg.v1 import
common_pb2`); they are rewritten to `from common.pb.disagg.v1 import common_pb2`. Generated
files whose .proto is gone are deleted. Each `*_pb2.py` names its .proto with the sha256 of its
text, so editing a .proto, even only its comments (which protoc does not carry into Python),
makes the generated code stale. The output depends only on the protos and the grpcio-tools
version, so two runs give identical bytes.

`--check` generates into a temporary directory and exits 1, listing the stale files, when
the committed code differs.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

PB_DIR = Path(__file__).resolve().parent
REPO_ROOT = PB_DIR.parents[1]
PROTO_DIR = REPO_ROOT / "protos"
PACKAGE = "common.pb"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def _import_rewriter(top_packages: set[str]):
    """Returns a function that makes protoc's references to our own modules absolute."""
    from_import = re.compile(r"^from (\w+)((?:\.\w+)*) import (\w+_pb2)\b", re.MULTILINE)
    bare_import = re.compile(r"^import (\w+_pb2)\b", re.MULTILINE)
    # The module name the message classes get (their __module__, which pickle imports).
    module_name = re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')([\w.]+_pb2')")

    def rewrite_from(match: re.Match) -> str:
        if match.group(1) not in top_packages:
            return match.group(0)
        return f"from {PACKAGE}.{match.group(1)}{match.group(2)} import {match.group(3)}"

    def rewrite(text: str) -> str:
        text = from_import.sub(rewrite_from, text)
        text = bare_import.sub(rf"from {PACKAGE} import \1", text)
        return module_name.sub(rf"\g<1>{PACKAGE}.\2", text)

    return rewrite


def _run_protoc(protos: list[Path], out_dir: Path) -> None:
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_DIR}",
        f"--proto_path={well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_DIR)) for p in protos),
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed (its errors are above)")


def render() -> dict[Path, bytes]:
    """Every generated file, as {path relative to common/pb: content}."""
    protos = proto_files()
    if not protos:
        sys.exit(f"no .proto files under {PROTO_DIR}")
    top_packages = {p.relative_to(PROTO_DIR).parts[0] for p in protos}
    rewrite = _import_rewriter(top_packages)
    files: dict[Path, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        _run_protoc(protos, Path(tmp))
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                files[path.relative_to(tmp)] = rewrite(path.read_text()).encode()
    for proto in protos:
        _stamp_source(files, proto.relative_to(PROTO_DIR))
    for rel in list(files):
        for parent in rel.parents:
            if parent != Path("."):
                files.setdefault(parent / "__init__.py", b"")
    return dict(sorted(files.items()))


def _stamp_source(files: dict[Path, bytes], proto: Path) -> None:
    """`# source: x.proto` → `# source: x.proto sha256=...` in the proto's `_pb2.py`."""
    rel = proto.with_name(proto.stem + "_pb2.py")
    digest = hashlib.sha256((PROTO_DIR / proto).read_bytes()).hexdigest()
    line = f"# source: {proto.as_posix()}".encode()
    files[rel] = files[rel].replace(line + b"\n", line + f" sha256={digest}\n".encode(), 1)


def _committed_generated() -> set[Path]:
    return {
        p.relative_to(PB_DIR)
        for p in PB_DIR.rglob("*")
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def stale_files(files: dict[Path, bytes]) -> list[Path]:
    """Files under common/pb that are missing, differ, or have no .proto any more."""
    stale = [rel for rel, content in files.items()
             if not (PB_DIR / rel).is_file() or (PB_DIR / rel).read_bytes() != content]
    stale += [rel for rel in _committed_generated() if rel not in files]
    return sorted(stale)


def write(files: dict[Path, bytes]) -> list[Path]:
    """Writes changed files, deletes orphans; returns what changed."""
    changed = stale_files(files)
    for rel in changed:
        path = PB_DIR / rel
        if rel in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(files[rel])
        else:
            path.unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.pb.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed generated code is stale; write nothing")
    args = parser.parse_args(argv)
    files = render()
    if args.check:
        stale = stale_files(files)
        if stale:
            listing = "\n".join(f"  common/pb/{rel}" for rel in stale)
            print(f"generated code is stale; run `python -m common.pb.generate`:\n{listing}", file=sys.stderr)
            return 1
        print(f"generated code is up to date ({len(files)} files)")
        return 0
    changed = write(files)
    print(f"wrote {len(changed)} of {len(files)} files under common/pb/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
