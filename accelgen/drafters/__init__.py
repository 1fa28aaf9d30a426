"""Drafters, one file per method (accelgen/method_table.py lists them); `base` holds the contract they share."""
