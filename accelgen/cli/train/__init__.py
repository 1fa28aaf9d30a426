"""`accelgen train ...`: what some methods need before they pay, trained on the CPU or a GPU. One module per trainer,
its flags generated from its dataclasses (accelgen/cli/flags.py):

    layerskip      fine-tune so that early exits become accurate (train/layerskip.py)
    exit-heads     exit adapters and CALM's classifiers on a frozen model (train/exit_heads.py)
    mpee           MPEE's exit classifiers, by weighted self-distillation on a frozen model (train/mpee.py)
    consistent-ee  ConsistentEE's exit policy, by policy gradient (train/consistent_ee.py)
    medusa         Medusa / blockwise heads on the frozen target's last hidden states (train/medusa.py)
    eagle          an EAGLE head: one decoder layer over the frozen target's features (train/eagle.py)
    pass           PaSS look-ahead embeddings, so that the frozen target drafts for itself (train/pass_embeddings.py)
    bita / space   mask tokens (+ BiTA's prompts, SPACE's mask-position LoRA) for drafting in the verifying forward
    distillspec    distil a draft model toward the target on the draft's own generations (train/distill.py)
    speed-model    a model whose layers share weights in a cycle, for SPEED (train/speed.py)
    sot-router     Skeleton-of-Thought's router on the model's features of a question (skeleton/router.py)
    cllm           consistency fine-tuning on the model's own Jacobi trajectories (train/cllm.py)
    online         stream requests through `online` and watch the draft's acceptance rise (train/online.py)
    nar            a non-autoregressive model (or the AR student) on the code-summary task (accelgen/nar/)
"""

from __future__ import annotations

from accelgen.cli.flags import App
from accelgen.cli.train import mpee
from accelgen.cli.train import bita, space  # (mask tokens: train/mask_tokens.py)
from accelgen.cli.train import (cllm, consistent_ee, distillspec, eagle, exit_heads, layerskip, medusa, online,
                                 pass_embeddings, sot_router)
from accelgen.cli.train import nar as nar_trainer
from accelgen.cli.train import speed as speed_trainer

train_app = App(no_args_is_help=True, help="Train what some methods need (on the CPU or a GPU).")

train_app.command("layerskip")(layerskip.layerskip_command)
train_app.command("exit-heads")(exit_heads.exit_heads_command)
train_app.command("mpee")(mpee.mpee_command)
train_app.command("consistent-ee")(consistent_ee.consistent_ee_command)
train_app.command("medusa")(medusa.medusa_command)
train_app.command("eagle")(eagle.eagle_command)
train_app.command("pass")(pass_embeddings.pass_command)
train_app.command("bita")(bita.bita_command)
train_app.command("space")(space.space_command)
train_app.command("distillspec")(distillspec.distillspec_command)
train_app.command("online")(online.online_command)
train_app.command("cllm")(cllm.cllm_command)
train_app.command("sot-router")(sot_router.sot_router_command)
train_app.command("speed-model")(speed_trainer.speed_model_command)
train_app.command("nar")(nar_trainer.nar_command)
