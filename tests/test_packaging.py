"""setup.cfg lists its packages by name (patches/ sits outside plugin/): none may be forgotten."""
from __future__ import annotations

import configparser
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_package_directory_is_listed_in_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    listed = set(cfg["options"]["packages"].split())
    found = {"hotspare_patches"}
    base = os.path.join(ROOT, "plugin")
    for dirpath, _dirs, files in os.walk(base):
        if "__init__.py" in files and "__pycache__" not in dirpath:
            found.add(os.path.relpath(dirpath, base).replace(os.sep, "."))
    assert listed == found, f"setup.cfg [options] packages: add {sorted(found - listed)}, drop {sorted(listed - found)}"
    assert os.path.isfile(os.path.join(ROOT, "patches", "__init__.py"))
