"""The EAGLE head: untrained, it passes the target's feature through (training starts from there)."""

import torch

from accelgen.heads.eagle import new_head
from accelgen.train.eagle import collect_features, whole_windows


def test_an_untrained_head_passes_the_feature_through(tiny_target, tiny_target_windows):
    windows = tiny_target_windows[:2]
    features, _ = collect_features(tiny_target, windows)
    head = new_head(tiny_target)
    output = head(tiny_target.get_input_embeddings()(windows), features, *whole_windows(windows.shape[1]))
    assert torch.allclose(output, features, atol=1e-5)
