"""pdsdk's one compiled part: the KV index's hot part (router/kvindex/_kvindex.c). Optional: without a C
compiler pdsdk still installs, and the router's index keeps its blocks in Python at a fraction of the speed.
Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pdsdk.router.kvindex._kvindex", ["router/kvindex/_kvindex.c"], optional=True)])
