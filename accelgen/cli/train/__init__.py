"""`accelgen train ...`: what some methods need before they pay, trained on this CPU. One module per trainer, its
flags generated from its dataclasses (accelgen/cli/flags.py):

    layerskip      fine-tune so that early exits become accurate (train/layerskip.py)
    exit-heads     exit adapters and CALM's classifiers on a frozen model (train/exit_heads.py)
    consistent-ee  ConsistentEE's exit policy, by policy gradient (train/consistent_ee.py)
    medusa         Medusa / blockwise heads on the frozen target's last hidden states (train/medusa.py)
    eagle          an EAGLE head: one decoder layer over the frozen target's features (train/eagle.py)
    pass           PaSS look-ahead embeddings, so that the frozen target drafts for itself (train/pass_embeddings.py)
    distillspec    distil a draft model toward the target on the draft's own generations (train/distill.py)
    sot-router     Skeleton-of-Thought's router on the model's features of a question (skeleton/router.py)
    online         stream requests through `online` and watch the draft's acceptance rise (train/online.py)
"""

from __future__ import annotations

import typer

from accelgen.cli.train import (consistent_ee, distillspec, eagle, exit_heads, layerskip, medusa, online,
                                 pass_embeddings, sot_router)

train_app = typer.Typer(no_args_is_help=True, help="Train what some methods need, on this CPU.")

train_app.command("layerskip")(layerskip.layerskip_command)
train_app.command("exit-heads")(exit_heads.exit_heads_command)
train_app.command("consistent-ee")(consistent_ee.consistent_ee_command)
train_app.command("medusa")(medusa.medusa_command)
train_app.command("eagle")(eagle.eagle_command)
train_app.command("pass")(pass_embeddings.pass_command)
train_app.command("distillspec")(distillspec.distillspec_command)
train_app.command("online")(online.online_command)
train_app.command("sot-router")(sot_router.sot_router_command)
