# Sphinx + myst-nb + sphinx-book-theme: builds offline (Jupyter Book 2 downloads its theme at build time).
# `make book` executes the notebooks into book/_build/src/notebooks first; Sphinx only renders them.
project = "minivllm: an LLM inference engine, built step by step"
author = "the minivllm authors"
copyright = "2026, the minivllm authors"
extensions = ["myst_nb", "sphinx-mathjax-offline"]  # MathJax from the build, not a CDN: the book reads offline
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "amsmath"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
html_theme = "sphinx_book_theme"
html_title = "minivllm"
# pydata-sphinx-theme >= 0.17.1 re-injects its navbar under sphinx-book-theme: a second search box on top, and
# sidebar toggles wired to the hidden copy. Naming navbar_persistent stops it (sphinx-book-theme issue 988).
html_theme_options = {"show_toc_level": 2, "navbar_persistent": []}
suppress_warnings = ["mystnb.unknown_mime_type"]
