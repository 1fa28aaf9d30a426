import pytest
import torch

from accelgen.sampling import SamplingConfig, logits_to_probs


def test_temperature_one_is_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(logits_to_probs(logits, SamplingConfig(temperature=1.0)), torch.softmax(logits, -1))


def test_top_k_keeps_k_best():
    probs = logits_to_probs(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingConfig(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [False, True, True, False]
    assert float(probs.sum()) == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # the best token always survives, however small top_p is
    assert logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.01)).tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)
