"""Training, on the CPU or a GPU: what some methods need before they pay (trained heads, distilled drafts, LayerSkip's
accurate early exits, CALM's calibrated threshold), and the `online` method, whose drafter also learns."""
