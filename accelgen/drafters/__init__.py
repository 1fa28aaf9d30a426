"""Drafters, one file per method; importing this package registers them all."""

from accelgen.drafters import autoregressive, draft_model  # noqa: F401
