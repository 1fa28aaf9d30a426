"""Training on this CPU: what some methods need before they pay (LayerSkip's accurate early exits)."""
