"""Which fused-operator library an export takes: an installed wheel's prebuilt one for this CPU's level, else its
baseline one, without compiling; else the source build, which says why; where neither can be had, the reason names
both. (`make wheel-check` runs the real thing: the built wheel's libraries, in an environment with no compiler.)"""

from __future__ import annotations

import shutil

import pytest

from exporters.native import library
from runtime.custom_ops import base_tag, platform_tag


@pytest.fixture
def install(tmp_path, monkeypatch):
    """An install's prebuilt/ folder, empty until a test puts libraries in it."""
    folder = tmp_path / "prebuilt"
    folder.mkdir()
    monkeypatch.setattr(library, "PREBUILT", folder)
    return folder


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("KVG_NATIVE_CACHE", str(tmp_path / "cache"))


def _carry(install, tag: str, source) -> None:
    (install / tag).mkdir()
    shutil.copy(source, install / tag / library.LIBRARY_NAME)


def test_an_install_takes_its_prebuilt_library_for_this_cpu_without_a_compiler(install, no_compiler, tmp_path):
    built = tmp_path / "built.so"
    built.write_bytes(b"the library a wheel carries")  # find() only picks the file; the wheel check loads them
    _carry(install, platform_tag(), built)
    _carry(install, base_tag(), built)
    _carry(install, "linux-riscv64", built)
    assert library.find() == install / platform_tag() / library.LIBRARY_NAME
    assert library.built_for(library.find()) == platform_tag()


def test_a_cpu_the_install_has_no_level_for_takes_the_baseline_library(install, no_compiler, tmp_path):
    built = tmp_path / "built.so"
    built.write_bytes(b"the baseline library")
    _carry(install, base_tag(), built)
    _carry(install, "linux-riscv64", built)
    assert library.find() == install / base_tag() / library.LIBRARY_NAME
    assert library.built_for(library.find()) == base_tag()


def test_a_source_build_is_for_this_machines_own_tag(tmp_path):
    assert library.built_for(tmp_path / f"{platform_tag()}-0123456789abcdef" / library.LIBRARY_NAME) == platform_tag()


def test_without_one_for_this_cpu_the_reason_names_what_the_install_carries_and_why_no_build(
    install, no_compiler, tmp_path, capsys
):
    other = tmp_path / "other.so"
    other.write_bytes(b"a library for another machine")
    _carry(install, "linux-riscv64", other)
    with pytest.raises(library.NativeUnavailable) as refused:
        library.find()
    said = str(refused.value)
    assert f"prebuilt libraries for linux-riscv64, none that runs on {platform_tag()}" in said
    assert "no C++ compiler" in said
    assert library.available() is None
    assert capsys.readouterr().err == f"fused attention: unavailable ({said}); attending through GroupQueryAttention\n"


def test_a_checkout_says_it_carries_none(install, no_compiler):
    with pytest.raises(library.NativeUnavailable, match="this install carries no prebuilt library"):
        library.find()


@pytest.mark.parametrize(
    ("tag", "flags"),
    [
        ("linux-x86_64", ["-march=x86-64"]),
        ("linux-x86_64-x86-64-v3", ["-march=x86-64-v3"]),
        ("linux-aarch64", []),
        ("darwin-arm64", []),
    ],
)
def test_each_tag_compiles_for_its_own_instruction_set(tag, flags):
    assert library._march(tag) == flags


def test_a_wheel_built_on_x86_64_linux_carries_the_baseline_and_x86_64_v3():
    if base_tag() != "linux-x86_64":
        assert library.prebuilt_tags() == []
    else:
        assert library.prebuilt_tags() == ["linux-x86_64", "linux-x86_64-x86-64-v3"]
