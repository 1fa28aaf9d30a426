"""Early-exit methods, one file per method (accelgen/method_table.py lists them).

Each builds an exit rule for `models.early_exit.EarlyExitRunner`, the target's forward that leaves the layer
stack early, and drafts nothing (the loop then commits one token per step, from wherever the token exited).
`ppd` reads an exit differently: to start the next token early, while every token still comes from the last layer.
"""
