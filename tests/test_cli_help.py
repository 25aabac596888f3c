"""Every command-line tool the package installs prints its help (argparse formats help text lazily, so a
bad one fails only when asked)."""

import importlib
from pathlib import Path

import pytest
import tomllib

SCRIPTS = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_the_help_of_each_command_prints(script, capsys):
    module, function = SCRIPTS[script].split(":")
    with pytest.raises(SystemExit) as exited:
        getattr(importlib.import_module(module), function)(["--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_kvg_export_names_the_version_pyproject_gives(capsys):
    from exporters.pipeline.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out == f"kvg-export {project['version']}\n"
