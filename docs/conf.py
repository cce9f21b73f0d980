"""Sphinx configuration: the provider guides (Markdown, through MyST) and the contract reference generated from
the hook specifications. Built by tests/core/test_docs_build.py with warnings as errors:
``python -m sphinx -W -b html docs docs/_build``."""

project = "onnx-runtime"
extensions = ["sphinx.ext.autodoc", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
myst_heading_anchors = 3
html_theme = "alabaster"
