"""The ``"last"`` token reduction: each sequence's last real token, for right, left and holed masks, against a loop."""

import warnings

import pytest
import torch

from rank_lightning.functional import effective_rank, total_cluster_variation
from rank_lightning.functional.reductions import (
    REDUCTIONS,
    TOKEN_REDUCTIONS,
    masked_token_rows,
    reduce_activations,
    token_rows_per_sample,
)
from rank_lightning.metrics import ActivationSpectrum, activation_spectrum
from rank_lightning.plotting import figure_title

# Right padding, left padding, a mask with holes (packed), a full row, and a row without any real token.
MASK = torch.tensor(
    [[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool
)
LAST = [2, 4, 3, 4, None]  # the last true position of each row


def _tokens() -> torch.Tensor:
    x = torch.randn(5, 5, 3, generator=torch.Generator().manual_seed(0))
    return x.masked_fill(~MASK.unsqueeze(2), float("nan"))  # padding holds NaN, which must never show


def test_last_takes_the_last_true_position_of_right_left_and_holed_masks():
    x = _tokens()
    rows = reduce_activations(x, "last", mask=MASK)
    assert torch.equal(rows, torch.stack([x[b, t] for b, t in enumerate(LAST) if t is not None]))
    assert token_rows_per_sample(MASK, "last").tolist() == [1, 1, 1, 1, 0]
    # Masks of 0 / 1 integers or floats read alike; without a mask, position T - 1.
    assert torch.equal(reduce_activations(x, "last", mask=MASK.float()), rows)
    assert torch.equal(reduce_activations(x[:4].nan_to_num(7.0), "last"), x[:4, -1].nan_to_num(7.0))


def test_masked_rows_keep_a_zero_row_for_a_sample_without_real_tokens():
    rows, real = masked_token_rows(_tokens(), "last", MASK, dtype=torch.float64)
    assert real.tolist() == [True, True, True, True, False]
    assert rows.dtype == torch.float64 and rows[4].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(rows).all()


def test_last_is_a_token_reduction_and_named_in_the_errors():
    assert "last" in TOKEN_REDUCTIONS and "last" in REDUCTIONS
    with pytest.raises(ValueError, match=r"reduction 'last' is not defined for conv activations.*'channel', 'mean'"):
        reduce_activations(torch.zeros(2, 3, 4, 4), "last")
    with pytest.raises(ValueError, match=r"unknown reduction 'end'; valid choices are .*'mean', 'last'\)"):
        reduce_activations(torch.zeros(2, 3, 4), "end")
    with pytest.raises(ValueError, match=r"unknown reduction 'end'; valid choices are: .*mean, last"):
        ActivationSpectrum(reduction="end")


@pytest.mark.parametrize("in_place", [False, True], ids=["selected", "in_place"])
@pytest.mark.parametrize("options", [{}, {"max_gram_features": 2, "max_samples": 8}], ids=["gram", "sample_gram"])
def test_the_spectrum_and_class_sums_of_last_tokens_with_labels_per_sample(monkeypatch, in_place, options):
    # in_place: the rows of a GPU, where the dropped sample's row stays in place and is counted out on the device.
    monkeypatch.setattr(activation_spectrum, "_keeps_padded_rows", lambda device: in_place)
    x, labels = _tokens(), torch.tensor([0, 1, 1, 0, 1])
    metric = ActivationSpectrum(num_classes=2, reduction="last", **options)
    metric.update(x, labels, mask=MASK)
    result = metric.compute()
    rows = torch.stack([x[b, t] for b, t in enumerate(LAST) if t is not None]).double()
    assert result.num_samples == 4 and result.num_nonfinite_batches == 0
    assert result.path == ("sample_gram" if options else "gram")
    assert float(result.uncentered.effective_rank) == pytest.approx(float(effective_rank(rows)), rel=1e-9)
    expected_tcv = float(total_cluster_variation(rows, labels[:4], num_classes=2))
    assert float(result.total_cluster_variation) == pytest.approx(expected_tcv, rel=1e-9)
    assert result.class_counts.tolist() == [2, 2]  # the fully padded sample left with its label
    with pytest.raises(ValueError, match=r"labels per token \(B, T\) need reduction='token'.*reduction='last'"):
        metric.update(x, torch.zeros(5, 5, dtype=torch.long), mask=MASK)


def test_cls_under_left_padding_is_named_in_a_warning():
    x = _tokens()[:4].nan_to_num(0.0)
    right, left = MASK[[0, 3]], MASK[[1, 3]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reduce_activations(x[:2], "cls", mask=right)
        ActivationSpectrum(reduction="cls").update(x[:2], mask=right)
    with pytest.warns(UserWarning, match=r"reduction='cls'.*left padding.*use reduction='last'"):
        reduce_activations(x[:2], "cls", mask=left)
    with pytest.warns(UserWarning, match=r"reduction='cls'.*left padding.*use reduction='last'"):
        ActivationSpectrum(reduction="cls").update(x[:2], mask=left)


def test_figures_name_the_last_token_reduction():
    assert "last real token" in figure_title("rank", "last/effective_rank")
