"""The wheel's build beyond pyproject.toml: the fused attention operator compiled for each x86-64 level the wheel
carries (exporters/native/library.py's prebuilt_tags), and the platform tag a wheel holding native code needs.

The libraries are loaded by onnxruntime, not by Python, so the wheel is tagged py3-none-<platform>. An editable
install (`make setup`) builds nothing here; the checkout builds its library from source.
"""

import sys
from pathlib import Path

from setuptools import Command, Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build import build
from setuptools.errors import CompileError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exporters.native import library  # the checkout being built, not an installed copy


class BuildNative(Command):
    """Compile exporters/native/fox_attention.cc for each prebuilt tag into the build's exporters/native/prebuilt/."""

    description = "compile the fused attention operator for each x86-64 level the wheel carries"
    user_options = []

    def initialize_options(self) -> None:
        self.build_lib = None
        self.editable_mode = False  # set by setuptools' editable install

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _folder(self) -> Path:
        return Path(self.build_lib) / library.PREBUILT.relative_to(Path(__file__).resolve().parent)

    def run(self) -> None:
        if self.editable_mode:
            return
        for tag in library.prebuilt_tags():
            try:
                built = library.build_prebuilt(tag, self._folder())
            except library.NativeUnavailable as error:
                raise CompileError(f"the wheel carries the fused operator prebuilt for {tag}: {error}") from None
            print(f"fused attention: {built} ({tag})")

    def get_outputs(self) -> list[str]:
        if self.editable_mode:
            return []
        return [str(self._folder() / tag / library.LIBRARY_NAME) for tag in library.prebuilt_tags()]

    def get_source_files(self) -> list[str]:
        return [str(library.SOURCE.relative_to(Path(__file__).resolve().parent))]


class BuildWithNative(build):
    sub_commands = [*build.sub_commands, ("build_native", None)]


class NativeDistribution(Distribution):
    """Native code where prebuilt libraries are built: installed to platlib, and the wheel not a pure one."""

    def has_ext_modules(self) -> bool:
        return bool(library.prebuilt_tags())


class PlatformWheel(bdist_wheel):
    """py3-none-<platform> where the wheel holds prebuilt libraries (any Python 3: onnxruntime loads them, not the
    interpreter); py3-none-any where it holds none."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, platform = super().get_tag()
        return (python, abi, platform) if self.root_is_pure else ("py3", "none", platform)


setup(
    distclass=NativeDistribution,
    cmdclass={"build": BuildWithNative, "build_native": BuildNative, "bdist_wheel": PlatformWheel},
)
