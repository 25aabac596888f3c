"""The fused FoX attention operator as a runtime sees it: which library an artifact names, and whether this machine
can load it.

A fused artifact (kvg-export --attention fused) carries the compiled library beside model.onnx, and its manifest's
`custom_ops` names it: the file, the op's domain and version, and the platform it was built for; one exported from a
wheel's prebuilt libraries carries the others for its OS and machine too (`other_platforms`, by platform). Any
onnxruntime user runs the folder by registering that file (`SessionOptions.register_custom_ops_library`); this
module does so for the runtime, with the library this CPU runs best, so that a library that cannot load is a
message, not a crash.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

# x86-64 levels the library may be built for, by the CPU flags each needs beyond the one before
X86_LEVELS = {"x86-64-v3": {"avx2", "fma", "bmi2", "f16c"}}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((row for row in text.splitlines() if row.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def base_tag() -> str:
    """This OS and machine, with no instruction-set level: what a library built for the baseline runs on."""
    return f"{sys.platform}-{platform.machine().lower()}"


def platform_tag() -> str:
    """What a library built here runs on: OS, machine and, on x86-64, the instruction-set level it is built for
    (x86-64-v3, AVX2 and FMA, where this CPU has them)."""
    level = next((name for name, flags in X86_LEVELS.items() if flags <= _cpu_flags()), None)
    return base_tag() if level is None else f"{base_tag()}-{level}"


def can_run(tag: str) -> bool:
    """Whether a library built for `tag` runs here: the same OS and machine, and an instruction-set level this CPU
    has."""
    if tag == base_tag():
        return True
    level = tag.removeprefix(f"{base_tag()}-")
    return level in X86_LEVELS and X86_LEVELS[level] <= _cpu_flags()


def register(settings, folder: Path, entry: dict) -> None:
    """Register the artifact's library with onnxruntime `settings`, the one of those it carries (`file`, and by
    platform `other_platforms`, see exporters/native/library.py's companions) that this CPU runs best; raise
    ValueError naming the fix where it cannot."""
    carried = {entry["platform"]: entry["file"], **entry.get("other_platforms", {})}
    fix = "re-export the model on this machine (kvg-export ... --force), or export it with --attention gqa"
    runnable = sorted((tag for tag in carried if can_run(tag)), key=_level)
    if not runnable:
        built = ", ".join(carried)
        raise ValueError(f"{folder / entry['file']} was built for {built} and this machine is {platform_tag()}; {fix}")
    library = folder / carried[runnable[-1]]
    if not library.is_file():
        raise ValueError(f"{library} is missing: the graph's {entry['domain']} attention op lives there; {fix}")
    try:
        settings.register_custom_ops_library(str(library))
    except Exception as error:  # onnxruntime's own exception types
        raise ValueError(f"onnxruntime cannot load {library}: {error}; {fix}") from None


def _level(tag: str) -> int:
    """How capable a CPU a runnable tag asks for: 0 for the baseline, then each of X86_LEVELS in order."""
    levels = list(X86_LEVELS)
    level = tag.removeprefix(f"{base_tag()}-")
    return levels.index(level) + 1 if level in levels else 0
