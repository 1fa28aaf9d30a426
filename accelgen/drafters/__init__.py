"""Drafters, one file per method (accelgen/methods.py lists them); `base` holds the contract they share."""
