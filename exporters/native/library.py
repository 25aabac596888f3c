"""The fused FoX attention operator's library (exporters/native/fox_attention.cc): an installed wheel's prebuilt one
for this CPU, else built with this machine's C++ compiler against onnxruntime's C API headers and cached by
everything that went into it.

A wheel built on x86-64 Linux carries the library compiled for the baseline x86-64 and for x86-64-v3 (setup.py's
build_native), one folder per platform tag under prebuilt/; an export takes the one for this CPU's tag
(runtime/custom_ops.py's platform_tag), else the baseline, which every x86-64 runs, so it needs no compiler. Where
the install carries none this CPU runs (a checkout, another machine or OS), the source build is the fallback, and it
says why before compiling.

The headers come from, in order: the folder KVG_ORT_HEADERS names, an installed libonnxruntime-dev
(/usr/include/onnxruntime), or Debian 13's libonnxruntime-dev package, which apt fetches into the cache with a
sources list, state and cache folders of its own (nothing on the machine changes, nothing is installed) and dpkg
unpacks there. The headers are API version 21 (onnxruntime 1.21); onnxruntime serves older API versions, so the
library loads in the onnxruntime this project installs.

`make setup` runs this module, which builds the library or says in one line why it cannot; an export with
`--attention fused` (or `auto`, on the CPU) finds or builds it. Where it cannot be had, exports attend through
GroupQueryAttention, and `auto` says why on stderr.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from runtime.contract import OP_DOMAIN, OP_NAME, OP_VERSION
from runtime.custom_ops import X86_LEVELS, base_tag, platform_tag

SOURCE = Path(__file__).parent / "fox_attention.cc"
PREBUILT = Path(__file__).parent / "prebuilt"  # an installed wheel's libraries, one folder per platform tag
LIBRARY_NAME = "libkvg_fox_attention.so"
HEADER = "onnxruntime_cxx_api.h"
INSTALLED_HEADERS = Path("/usr/include/onnxruntime")
DEBIAN = "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main"
HEADER_PACKAGE = "libonnxruntime-dev"
# -fno-trapping-math: the softmax's clamps and selects may then be computed for every lane, which is what lets the
# compiler vectorize its loops at all (measured: a 256-query chunk's exponentials and maxima 37% of its time
# without it, 14% with it)
FLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
         "-fvisibility=hidden"]  # fmt: skip


class NativeUnavailable(Exception):
    """The library cannot be built here; the message says why and what a user may do."""


def cache_folder() -> Path:
    return Path(os.environ.get("KVG_NATIVE_CACHE", Path.home() / ".cache" / "kvg-export" / "native"))


def _march(tag: str) -> list[str]:
    """The instruction-set flag for `tag`: its x86-64 level; the baseline x86-64 named, not left to the compiler's
    default, which some distributions raise; none off x86-64."""
    level = next((name for name in X86_LEVELS if tag.endswith(f"-{name}")), None)
    if level:
        return [f"-march={level}"]
    return ["-march=x86-64"] if tag.endswith("x86_64") else []


def prebuilt_tags() -> list[str]:
    """The platform tags a wheel built on this machine carries the library for: on x86-64 Linux the baseline and
    each level of X86_LEVELS, whatever this CPU has; elsewhere none (the source build serves there)."""
    return _machine_tags() if base_tag() == "linux-x86_64" else []


def _machine_tags() -> list[str]:
    """This OS and machine's baseline tag, then its x86-64 levels'."""
    return [base_tag(), *(f"{base_tag()}-{level}" for level in X86_LEVELS)]


def prebuilt() -> Path | None:
    """This install's prebuilt library that this CPU runs best: its own level's, else the baseline's; None where the
    install carries neither (a checkout, another platform)."""
    for tag in dict.fromkeys((platform_tag(), base_tag())):
        library = PREBUILT / tag / LIBRARY_NAME
        if library.is_file():
            return library
    return None


def built_for(library: Path) -> str:
    """The platform tag `library` runs on: its prebuilt folder's, else this machine's (a source build's)."""
    return library.parent.name if library.parent.parent == PREBUILT else platform_tag()


def companions(library: Path) -> dict[str, Path]:
    """The install's other prebuilt libraries for this OS and machine (its baseline and x86-64 levels), by tag, which
    an artifact carries beside `library` so that it runs on any CPU of its kind (the runtime takes the best one the
    CPU runs); none beside a source build, which is for this machine alone."""
    if library.parent.parent != PREBUILT:
        return {}
    found = {tag: PREBUILT / tag / LIBRARY_NAME for tag in _machine_tags()}
    return {tag: path for tag, path in found.items() if path.is_file() and path != library}


def companion_name(tag: str) -> str:
    """The file a companion library for `tag` is carried in, beside the artifact's own library."""
    return f"{Path(LIBRARY_NAME).stem}.{tag}.so"


def _why_no_prebuilt() -> str:
    carried = sorted(path.parent.name for path in PREBUILT.glob(f"*/{LIBRARY_NAME}"))
    if not carried:
        return "this install carries no prebuilt library"
    return f"this install carries prebuilt libraries for {', '.join(carried)}, none that runs on {platform_tag()}"


def _run(command: list[str], cwd: Path | None = None) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        said = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "no output")
        raise NativeUnavailable(f"`{Path(command[0]).name} {command[1]} ...` failed: {said.strip()}")


def _fetch_headers(root: Path) -> Path:
    """Debian 13's libonnxruntime-dev, downloaded by apt with private folders and unpacked under `root`."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise NativeUnavailable(
            "no onnxruntime C API headers: install libonnxruntime-dev (Debian 13, Ubuntu 25.04) or set "
            "KVG_ORT_HEADERS to a folder holding onnxruntime_cxx_api.h"
        )
    headers = root / "usr" / "include" / "onnxruntime"
    with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
        apt = Path(scratch)
        for folder in ("lists/partial", "cache/archives/partial", "parts", "debs"):
            (apt / folder).mkdir(parents=True)
        (apt / "sources.list").write_text(DEBIAN + "\n")
        sandbox = "_apt" if os.geteuid() == 0 else os.environ.get("USER", "root")
        options = [f"-oDir::Etc::SourceList={apt / 'sources.list'}", f"-oDir::Etc::SourceParts={apt / 'parts'}",
                   f"-oDir::State::Lists={apt / 'lists'}", f"-oDir::Cache={apt / 'cache'}", "-oDebug::NoLocking=1",
                   f"-oAPT::Sandbox::User={sandbox}"]  # fmt: skip
        _run(["apt-get", "-q", *options, "update"])
        _run(["apt-get", "-q", *options, "download", HEADER_PACKAGE], cwd=apt / "debs")
        package = next((apt / "debs").glob("*.deb"))
        unpacked = Path(tempfile.mkdtemp(dir=root.parent))
        _run(["dpkg", "-x", str(package), str(unpacked)])
        os.replace(unpacked, root)
    return headers


def find_headers(given: Path | None = None) -> Path:
    """The folder holding onnxruntime_cxx_api.h: `given`, KVG_ORT_HEADERS, the installed package's, or fetched."""
    given = given or (Path(os.environ["KVG_ORT_HEADERS"]) if os.environ.get("KVG_ORT_HEADERS") else None)
    if given is not None:
        if not (given / HEADER).is_file():
            raise NativeUnavailable(f"{given} holds no {HEADER} (KVG_ORT_HEADERS names onnxruntime's include folder)")
        return given
    if (INSTALLED_HEADERS / HEADER).is_file():
        return INSTALLED_HEADERS
    root = cache_folder() / "onnxruntime-headers"
    headers = root / "usr" / "include" / "onnxruntime"
    if (headers / HEADER).is_file():
        return headers
    root.parent.mkdir(parents=True, exist_ok=True)
    return _fetch_headers(root)


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not compiler:
        raise NativeUnavailable("no C++ compiler (install g++, or set CXX)")
    return compiler


def _command(compiler: str, tag: str, include: Path) -> list[str]:
    """The compiler's command for a library that runs on `tag`, but for the source and output paths."""
    return [compiler, *FLAGS, f"-DKVG_FOX_OP_VERSION={OP_VERSION}", *_march(tag), f"-I{include}"]


def compile_library(command: list[str], library: Path) -> Path:
    """Run `command` (from _command) on the source into `library`, which appears whole or not at all."""
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.partial")
    try:
        _run([*command, str(SOURCE), "-o", str(partial)])
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
    return library


def build_prebuilt(tag: str, folder: Path) -> Path:
    """The library for `tag` compiled into `folder`/`tag`/ (a wheel's prebuilt/); raise NativeUnavailable."""
    compiler = _compiler()
    return compile_library(_command(compiler, tag, find_headers()), folder / tag / LIBRARY_NAME)


def build(headers: Path | None = None) -> Path:
    """The library, built if the cache lacks this source, header, compiler and flags' build; raise NativeUnavailable."""
    compiler, tag = _compiler(), platform_tag()
    include = find_headers(headers)
    command = _command(compiler, tag, include)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), (include / "onnxruntime_c_api.h").read_bytes(), version.encode(),
                 " ".join(command[1:-1]).encode()):  # fmt: skip
        digest.update(hashlib.sha256(part).digest())
    library = cache_folder() / f"{tag}-{digest.hexdigest()[:16]}" / LIBRARY_NAME
    if library.is_file():
        return library
    print(f"fused attention: {_why_no_prebuilt()}; compiling {SOURCE.name} for {tag}", file=sys.stderr, flush=True)
    return compile_library(command, library)


def find() -> Path:
    """The library for this machine: this install's prebuilt one for its CPU, else built from source (raise
    NativeUnavailable saying why neither)."""
    library = prebuilt()
    if library is not None:
        return library
    try:
        return build()
    except NativeUnavailable as error:
        raise NativeUnavailable(f"{_why_no_prebuilt()}, and the source build failed: {error}") from None


def library_version(library: Path) -> int:
    """The op version a built library implements, as it declares it to onnxruntime (its since-version): the
    OP_VERSION it was built with, which the library exports as KvgFoxOpVersion()."""
    return ctypes.CDLL(str(library)).KvgFoxOpVersion()


def manifest_entry(library: Path) -> dict:
    """What a fused artifact's manifest says of the library it carries and of its companions, by platform
    (runtime/custom_ops.py reads it)."""
    others = {tag: companion_name(tag) for tag in companions(library)}
    return {"file": library.name, "domain": OP_DOMAIN, "op": OP_NAME, "version": library_version(library),
            "platform": built_for(library)} | ({"other_platforms": others} if others else {})  # fmt: skip


def available() -> Path | None:
    """The library, or None (saying why on stderr) where this install has none for this CPU and cannot build one."""
    try:
        return find()
    except NativeUnavailable as error:
        print(f"fused attention: unavailable ({error}); attending through GroupQueryAttention", file=sys.stderr)
        return None


def main() -> int:
    """`python -m exporters.native.library`: build the library, one line either way; the exit is 0 both ways, since
    exports then fall back to GroupQueryAttention."""
    try:
        library = find()
    except NativeUnavailable as error:
        print(f"fused attention: not built ({error}); exports attend through GroupQueryAttention (--attention gqa)")
        return 0
    print(f"fused attention: {library} ({built_for(library)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
