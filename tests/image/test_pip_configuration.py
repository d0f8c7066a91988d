"""What a build inside the image is given of the machine's pip configuration (pure: no build, no root)."""

from __future__ import annotations

import configparser

from image_build import local_paths, pip_conf, pip_configuration


def test_the_listing_becomes_a_pip_conf_with_the_environment_winning(tmp_path):
    listing = (
        ":env:.find-links='/env/wheels'\n"
        "global.find-links='/file/wheels'\n"
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'\n"
        "install.no-compile='1'\n"
        "WARNING: not a setting\n"
    )
    sections = pip_configuration(listing)
    assert sections == {
        "global": {"find-links": "/env/wheels", "extra-index-url": "file:///opt/a/simple file:///opt/b/simple"},
        "install": {"no-compile": "1"},
    }
    parsed = configparser.ConfigParser()
    parsed.read_string(pip_conf(sections))
    assert parsed["global"]["find-links"] == "/env/wheels" and parsed["install"]["no-compile"] == "1"


def test_the_local_paths_named_are_mounted_an_index_with_the_folder_holding_it(tmp_path):
    (tmp_path / "pypi" / "simple").mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "constraints.txt").write_text("torch<=3\n")
    sections = {
        "global": {
            "extra-index-url": f"file://{tmp_path}/pypi/simple https://pypi.example/simple",
            "find-links": f"{tmp_path}/wheels {tmp_path}/gone",
            "constraint": f"{tmp_path}/constraints.txt",
            "default-timeout": "180",
        }
    }
    assert local_paths(sections) == [tmp_path / "pypi", tmp_path / "wheels", tmp_path / "constraints.txt"]
