"""The browser tier: chapter 06 in JupyterLab in a real Chromium.

A package, so that its conftest imports as ``browser.conftest`` beside ``tests/conftest.py``
(pytest --doctest-modules imports every conftest; two top-level ``conftest`` modules clash).
"""
