"""The pdsdk config of an SGLang worker: environment variable PDSDK_CONFIG (JSON or @file), read
and validated when the KV manager starts, so a bad config stops the server at launch with the
field named, not at the first request."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pdsdk.config import PdsdkConfig, load_config
from pdsdk.errors import ConfigError

ENV = "PDSDK_CONFIG"


def config_from_env(environ: Mapping[str, str] | None = None) -> PdsdkConfig:
    """The validated config; an unset or empty variable means the defaults (transport nixl)."""
    raw = (environ if environ is not None else os.environ).get(ENV, "").strip()
    try:
        config = load_config(raw or None)
    except ConfigError as e:
        raise ConfigError(f"{ENV} {e.field}".strip(), str(e).removeprefix(f"{e.field}: ")) from None
    if config.transport is None:
        raise ConfigError(f"{ENV} transport", "the SGLang transfer backend moves pages with a pdsdk transport; "
                                              'set one, e.g. {"transport": "nixl"}')
    return config
