"""The project's set-up files agree with each other."""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"pytorch": "torch"}  # conda's name -> PyPI's name


def _requirement(text):
    name, spec = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(.*)$", text).groups()
    return name.lower().replace("_", "-"), spec.replace(" ", "")


def pyproject_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return dict(_requirement(r) for r in requirements)


def environment_requirements():
    # environment.yml is a flat list; parsing it by line keeps this test free of a YAML dependency.
    text = (ROOT / "environment.yml").read_text()
    conda_section = text.split("dependencies:")[1].split("- pip:")[0]
    entries = re.findall(r"^\s*-\s*(\S+)\s*$", conda_section, flags=re.M)
    requirements = dict(_requirement(e) for e in entries if not re.match(r"^(python|pip)\b", e))
    return {CONDA_NAMES.get(name, name): spec for name, spec in requirements.items()}


def test_environment_yml_names_the_same_packages_and_bounds_as_pyproject():
    assert environment_requirements() == pyproject_requirements()


def test_environment_yml_installs_the_package_itself():
    assert re.search(r"- pip:\s*\n\s*- -e \.\s*$", (ROOT / "environment.yml").read_text(), flags=re.M)


def test_constraints_pin_every_direct_requirement_within_its_range():
    pins = dict(
        re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", line).groups()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    for name, spec in pyproject_requirements().items():
        assert name in pins, f"{name} is not pinned in constraints.txt"
        lower = re.match(r">=([\d.]+)", spec).group(1)
        assert _version(pins[name]) >= _version(lower), f"{name}=={pins[name]} is below pyproject's {spec}"


def test_torch_is_pinned_to_the_cpu_build():
    # A plain `torch==2.13.0` would let pip take the multi-GB CUDA wheel on a machine without the local CPU wheel.
    assert "torch==2.13.0+cpu" in (ROOT / "constraints.txt").read_text().splitlines()


def _version(text):
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


NEWS_PROMPT = "@jupyterlab/apputils-extension:announcements"  # asks "get notified about Jupyter news?"


def test_make_lab_opens_without_the_news_prompt_and_leaves_the_home_directory_alone(tmp_path):
    command = subprocess.run(["make", "-n", "--no-print-directory", "lab"], cwd=ROOT, capture_output=True,
                             text=True, check=True, env={**os.environ, "JUPYTER_CONFIG_PATH": ""}).stdout
    config_path = re.search(r'JUPYTER_CONFIG_PATH="([^"]*)" \S*jupyter lab', command).group(1)
    assert config_path == str(ROOT / ".jupyter")  # the project's configuration, in the project
    home = tmp_path / "home"
    home.mkdir()
    # The page configuration that JupyterLab serves, read as its server reads it, with this environment.
    page_config = subprocess.run(
        [sys.executable, "-c", "import json; from jupyterlab_server.config import get_static_page_config; "
                               "print(json.dumps(get_static_page_config()))"],
        capture_output=True, text=True, check=True,
        env={**os.environ, "HOME": str(home), "JUPYTER_CONFIG_PATH": config_path,
             "JUPYTER_CONFIG_DIR": str(home / ".jupyter")}).stdout
    assert json.loads(page_config)["disabledExtensions"][NEWS_PROMPT] is True
    assert list(home.iterdir()) == []
