"""Which fused-operator library an export takes: an installed wheel's prebuilt one for this CPU's level, else its
baseline one, without compiling; else the source build, which says why; where neither can be had, the reason names
both. (`make wheel-check` runs the real thing: the built wheel's libraries, in an environment with no compiler.)"""

from __future__ import annotations

import json
import shutil

import pytest

from exporters.native import library
from runtime import custom_ops
from runtime.artifact import Artifact, SessionOptions
from runtime.contract import MANIFEST_NAME
from runtime.custom_ops import base_tag, platform_tag
from runtime.errors import ArtifactError


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


V3 = "x86-64-v3"


def test_an_artifact_from_an_install_names_the_installs_other_levels_libraries(install):
    real = library.build()  # a real library: the manifest entry reads its version from it
    for tag in (base_tag(), f"{base_tag()}-{V3}", "linux-riscv64"):
        _carry(install, tag, real)
    entry = library.manifest_entry(install / base_tag() / library.LIBRARY_NAME)
    assert entry["platform"] == base_tag()
    assert entry["other_platforms"] == {f"{base_tag()}-{V3}": f"libkvg_fox_attention.{base_tag()}-{V3}.so"}
    assert "other_platforms" not in library.manifest_entry(real)  # a source build is for this machine alone


@pytest.fixture
def v3_artifact(exported, tmp_path):
    """A fused artifact whose own library says x86-64-v3, carrying the baseline one beside it as an install's export
    does: the same library's bytes under both names, the v3 one's file gone, so opening it proves which it took."""
    folder = tmp_path / "artifact"
    shutil.copytree(exported("fox-tiny", "dynamic", attention="fused")[0].path, folder)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    own = manifest["custom_ops"]
    baseline = library.companion_name(base_tag())
    (folder / own["file"]).rename(folder / baseline)
    own |= {"platform": f"{base_tag()}-{V3}", "other_platforms": {base_tag(): baseline}}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    return folder


def test_a_cpu_without_the_exporting_cpus_level_runs_the_baseline_library_the_artifact_carries(
    v3_artifact, monkeypatch
):
    monkeypatch.setattr(custom_ops, "_cpu_flags", set)  # a baseline x86-64: no AVX2
    assert Artifact.open(v3_artifact, SessionOptions(provider="cpu")).manifest["attention"] == "fused"
    manifest = json.loads((v3_artifact / MANIFEST_NAME).read_text())
    del manifest["custom_ops"]["other_platforms"]
    (v3_artifact / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"built for {base_tag()}-{V3} and this machine is {base_tag()}"):
        Artifact.open(v3_artifact, SessionOptions(provider="cpu"))
