"""Sphinx configuration of the shardscale docs (built by ``nox -s docs`` with -W)."""

from __future__ import annotations

import importlib.metadata

project = "shardscale"
author = "the shardscale authors"
copyright = "the shardscale authors"
try:
    release = importlib.metadata.version("shardscale-core")
except importlib.metadata.PackageNotFoundError:
    release = "0.1.0"
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the packages' docstrings use Google-style "Args:" sections
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "examples/**/README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "member-order": "bysource",
}
autodoc_typehints = "signature"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = f"shardscale {release}"
html_theme_options = {"description": "mixed precision for sharded PyTorch models"}
