"""pdsdk's one compiled part: the KV index's block hasher (router/_kvhash.c). Optional: without a C
compiler pdsdk still installs, and the router's index keys blocks in Python at about half the speed.
Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pdsdk.router._kvhash", ["router/_kvhash.c"], optional=True)])
